"""The WebRTC track's queue (server/api/webrtc.py): an engine faster than the track's fps loses the oldest frames,
and every chunk with a frame left still says where it starts on the track (the page's latency and chunk marks)."""

import asyncio

import numpy as np
import pytest

pytest.importorskip("aiortc", reason="WebRTC needs the webrtc extra: pip install '.[webrtc]'")

from longserve.server.api.webrtc import CLOCK, make_track  # noqa: E402


def test_a_chunk_whose_first_frames_were_dropped_is_announced_at_its_first_frame_sent():
    async def run():
        track = make_track(fps=1000, max_frames=4)        # a fast clock: the test does not wait on the pacing
        firsts = []
        track.on_first = lambda index, pts: firsts.append((index, pts))
        for index in range(3):                            # 3 chunks of 3 frames into a queue of 4: 5 dropped
            track.push(np.full((3, 4, 4, 3), index, np.uint8), index)
        frames = [await track.recv() for _ in range(4)]
        return track, firsts, frames

    track, firsts, frames = asyncio.run(run())
    assert track.dropped == 5
    assert [f.to_ndarray(format="rgb24")[0, 0, 0] for f in frames] == [1, 2, 2, 2]     # chunk 1's last, chunk 2
    assert [i for i, _ in firsts] == [1, 2]                                          # chunk 0: nothing left to send
    assert firsts[1][1] == frames[1].pts and frames[1].time_base.denominator == CLOCK
