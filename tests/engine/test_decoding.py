"""engine/decoding.py's FrameStream on a stand-in VAE path that says which frame each pixel is: every policy hands
out the frames it names, in order, in calls of at most `max_frames` (the families' decodes against diffusers are
tests/pipelines/)."""

import numpy as np
import torch

from longserve.engine.decoding import FramesPolicy, FrameStream
from longserve.engine.outputs import LiveChunkInfo, Sound


class FrameIds:
    """A VAE path whose pixels are (run, frame within the run): the first latent frame makes one, later ones
    `temporal` each."""

    def __init__(self, runs: list, temporal: int):
        self.run, self.temporal, self.made = len(runs), temporal, 0
        runs.append(self)

    def decode(self, latents, keep):
        n = sum(1 if self.made + i == 0 else self.temporal for i in range(latents.shape[2]))
        ids = [(self.run, self.made + i) for i in range(n)][keep]
        self.made += n
        return np.array(ids).reshape(1, len(ids), 2)

    def close(self):
        pass


def stream(policy, limit, max_frames, pushes, output="np"):
    """Push latent pieces (sizes, the last marked) and take frames until none is ready -> the calls' outputs."""
    runs = []
    s = FrameStream(policy, lambda z: FrameIds(runs, policy.temporal), output, 0, limit,
                    lead_frames=lambda a, b: np.array([("lead", i) for i in range(a, b)]).reshape(1, b - a, 2))
    for i, (size, live) in enumerate(pushes):
        s.push(torch.zeros(1, 2, size, 1, 1), live, last=i == len(pushes) - 1)
    calls = []
    while s.ready():
        calls.append((s.next(max_frames), s.handed_out()[1]))
    assert s.frames_out == limit
    return calls


def test_an_extension_hands_out_its_input_then_the_decoded_frames_past_the_remade_overlap():
    # 5 latent frames in two segments make 17 frames; the first 5 re-make the input's end; 3 input frames lead
    calls = stream(FramesPolicy(temporal=4, lead=3, skip=5), 3 + 12, 4, [(3, None), (2, None)])
    frames = [tuple(str(v) for v in f) for out, _ in calls for f in out[0]]
    assert frames == [("lead", str(i)) for i in range(3)] + [("0", str(i)) for i in range(5, 17)]
    assert all(out.shape[1] <= 4 for out, _ in calls)


def test_helios_chunks_decode_on_their_own_and_the_video_is_cut_to_its_length():
    # 3 chunks of 2 latent frames make 5 frames each; the video hands out 13
    calls = stream(FramesPolicy(temporal=4, run=2), 13, 100, [(2, None), (2, None), (2, None)])
    frames = [tuple(int(v) for v in f) for out, _ in calls for f in out[0]]
    assert frames == [(0, i) for i in range(5)] + [(1, i) for i in range(5)] + [(2, i) for i in range(3)]


def test_a_live_chunk_is_handed_out_whole_with_its_chunk_whatever_max_frames():
    pushes = [(3, LiveChunkInfo(i, int(i >= 1))) for i in range(2)] + [(1, LiveChunkInfo(2, 1))]
    calls = stream(FramesPolicy(temporal=4, whole=True), 1 + 6 * 4, 1, pushes)
    assert [out.shape[1] for out, _ in calls] == [9, 12, 4] and [info for _, info in calls] == [p[1] for p in pushes]
    latents = stream(FramesPolicy(temporal=4, whole=True), 25, 1, pushes, output="latent")
    assert [out.shape[2] for out, _ in latents] == [3, 3, 1]


def test_latents_of_a_long_video_come_out_in_one_piece_once_the_last_is_final():
    calls = stream(FramesPolicy(temporal=4), 17, 2, [(3, None), (2, None)], output="latent")
    assert len(calls) == 1 and calls[0][0].shape == (1, 2, 5, 1, 1)


def test_a_family_s_sound_is_handed_out_once_with_the_frames_that_follow_it():
    s = FrameStream(FramesPolicy(temporal=4), lambda z: FrameIds([], 4), "np", 0, 9)
    s.push(torch.zeros(1, 2, 1, 1, 1))
    s.push(torch.zeros(1, 2, 2, 1, 1), last=True)
    sound = Sound(np.zeros((1, 2, 10), np.float32), 24000)
    s.audio = sound                     # as LTX-2's decoder sets it before the first window
    s.next(1)
    assert s.handed_out() == (sound, None)
    s.next(100)
    assert s.handed_out() == (None, None)
