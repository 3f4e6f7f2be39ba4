"""Teacher forcing for `tools.weights.train_tiny_live` (recipe step 5, its module docstring): the two-stream form of
the causal runtime on diffusers' `WanTransformer3DModel` (attention processors that mask, position and caption the
clean and noisy chunks), the training windows ("start" and "sink") drawn from the encoded clips, and the flow loss
on the noisy chunks. The runtime's chunk geometry and the windows' settings live here, read by the trainer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# -- the runtime's chunk geometry (causal_config.json) ---------------------------------------------------------
F_B = 3                                        # latent frames a chunk (= video frames: no temporal compression)
LOCAL_ATTN_SIZE = 12                           # L: frames a chunk attends to, itself included
SINK_SIZE = 3                                  # K
CONTEXT_NOISE = 0
# -- the training windows ------------------------------------------------------------------------------------
SWITCH_WINDOW_PROB = 0.5                        # sink windows placed just after a colour change
RECACHE_PROB = 0.75                             # clean chunks under the current caption (else their own)
CONTEXT_AUG_PROB, CONTEXT_AUG_MAX = 0.5, 0.1    # noise on the clean stream (std, latents have std 1)
CONTEXT_BLUR_PROB, CONTEXT_BLUR_MAX = 0.5, 0.6  # the clean stream mixed towards its 3x3 spatial blur


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan rotary embedding on interleaved pairs; x (B, S, H, D), cos/sin (1, S, 1, D)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class Layout:
    """What the processors need for one forward: rotary (cos, sin), the self-attention mask and the
    cross-attention bias. Set by `two_stream_forward`, read by every block."""

    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    self_mask: torch.Tensor | None = None
    cross_bias: torch.Tensor | None = None


class SelfAttnProcessor:
    """WanAttnProcessor's self-attention with the layout's positions and mask."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        cos, sin = self.layout.rope
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=self.layout.self_mask)
        out = out.transpose(1, 2).flatten(2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class CrossAttnProcessor:
    """WanAttnProcessor's cross-attention with an additive bias (B, 1, S, N): each chunk its own caption."""

    def __init__(self, layout: Layout):
        self.layout = layout

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=self.layout.cross_bias)
        out = out.transpose(1, 2).flatten(2).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def install_processors(model) -> Layout:
    layout = Layout()
    for block in model.blocks:
        block.attn1.set_processor(SelfAttnProcessor(layout))
        block.attn2.set_processor(CrossAttnProcessor(layout))
    return layout


def restore_processors(model) -> None:
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    for block in model.blocks:
        block.attn1.set_processor(WanAttnProcessor())
        block.attn2.set_processor(WanAttnProcessor())


def two_stream_forward(model, layout: Layout, clean, noisy, noisy_chunks: list[int], t_noisy, text, text_bias,
                       clean_caption, noisy_caption):
    """The runtime's attention pattern in one pass (no cache).

    clean (B, C, Tc, h, w): clean chunks 0..Tc/F_B-1 at positions 0..Tc-1, timestep CONTEXT_NOISE;
    noisy (B, C, Tn, h, w): chunks `noisy_chunks` (their positions), timesteps t_noisy (B, len(noisy_chunks));
    text (P, N, 32) and text_bias (P, N): the compressed captions; clean_caption (B, Tc/F_B) and
    noisy_caption (B, len(noisy_chunks)): each chunk's prompt index. Returns the flow (B, C, Tn, h, w)."""
    B, C, Tc, h, w = clean.shape
    Tn = noisy.shape[2]
    p = model.config.patch_size
    per_frame = (h // p[1]) * (w // p[2])
    nc = Tc // F_B
    # positions: clean frame f at f, noisy chunk j's frames at j*F_B..j*F_B+F_B-1
    positions = list(range(Tc)) + [j * F_B + i for j in noisy_chunks for i in range(F_B)]
    cos, sin = model.rope(torch.zeros(1, C, max(positions) + 1, h, w))               # (1, T*pf, 1, D)
    rows = torch.tensor([f * per_frame + s for f in positions for s in range(per_frame)])
    layout.rope = (cos[:, rows], sin[:, rows])
    # self-attention mask over chunks: [clean 0..nc-1 | noisy chunks]
    chunk_of = torch.tensor([f // F_B for f in range(Tc)] + [j for j in noisy_chunks for _ in range(F_B)])
    is_noisy = torch.tensor([False] * Tc + [True] * Tn)
    qc, kc = chunk_of[:, None], chunk_of[None, :]
    qn, kn = is_noisy[:, None], is_noisy[None, :]
    frame_mask = (~qn & ~kn & (kc <= qc)) | (qn & ~kn & (kc < qc)) | (qn & kn & (kc == qc))   # (T, T)
    layout.self_mask = frame_mask.repeat_interleave(per_frame, 0).repeat_interleave(per_frame, 1)
    # cross-attention: slot per chunk (clean chunks, then noisy chunks), each its own caption
    captions = torch.cat([clean_caption, noisy_caption], dim=1)                       # (B, nc + nn)
    N = text.shape[1]
    slots = captions.shape[1]
    enc = text[captions].reshape(B, slots * N, -1)                                    # (B, slots*N, 32)
    slot_bias = text_bias[captions]                                                   # (B, slots, N)
    token_slot = torch.tensor([f // F_B for f in range(Tc)] + [nc + k for k in range(len(noisy_chunks))
                                                               for _ in range(F_B)])
    token_slot = token_slot.repeat_interleave(per_frame)                              # (S,)
    own = F.one_hot(token_slot, slots).bool()                                         # (S, slots)
    bias = torch.where(own[None, :, :, None], slot_bias[:, None, :, :], float("-inf"))  # (B, S, slots, N)
    layout.cross_bias = bias.reshape(B, 1, own.shape[0], slots * N)
    # per-token timesteps
    t_clean = torch.full((B, Tc * per_frame), float(CONTEXT_NOISE))
    t_tok = torch.cat([t_clean, t_noisy.repeat_interleave(F_B * per_frame, dim=1)], dim=1)
    out = model(torch.cat([clean, noisy], dim=2), timestep=t_tok, encoder_hidden_states=enc,
                return_dict=False)[0]
    return out[:, :, Tc:]


class Windows:
    """Training windows from the encoded clips: latents (N, C, T, h, w) and chunk prompts (N, T/F_B)."""

    def __init__(self, latents: torch.Tensor, prompts: torch.Tensor, generator: torch.Generator):
        self.latents, self.prompts, self.g = latents, prompts, generator
        self.chunks = latents.shape[2] // F_B
        self.switches = [(i, c) for i in range(len(prompts)) for c in range(1, self.chunks)
                         if prompts[i, c] != prompts[i, c - 1]]

    def _int(self, n: int) -> int:
        return int(torch.randint(n, (1,), generator=self.g))

    def _rand(self) -> float:
        return float(torch.rand(1, generator=self.g))

    def _clean_captions(self, chunk_caps: torch.Tensor, current: int) -> torch.Tensor:
        if bool((chunk_caps != current).any()) and self._rand() < RECACHE_PROB:
            return torch.full_like(chunk_caps, current)
        return chunk_caps

    def start(self, batch: int):
        """The first L frames of clips: clean chunks 0..n-2, noisy chunks 0..n-1."""
        n = LOCAL_ATTN_SIZE // F_B
        x0, clean_caps, noisy_caps = [], [], []
        for _ in range(batch):
            i = self._int(len(self.latents))
            x0.append(self.latents[i, :, :n * F_B])
            caps = self.prompts[i, :n]
            noisy_caps.append(caps)
            clean_caps.append(self._clean_captions(caps[:-1], int(caps[-1])))
        return torch.stack(x0), list(range(n)), torch.stack(clean_caps), torch.stack(noisy_caps)

    def sink(self, batch: int):
        """The sink (a clip's first K frames) + a later stretch: clean chunks 0..n-2, noisy chunk n-1."""
        n = LOCAL_ATTN_SIZE // F_B
        sink_chunks = SINK_SIZE // F_B
        recent = n - 1 - sink_chunks                                                  # clean chunks after the sink
        x0, clean_caps, noisy_caps = [], [], []
        for _ in range(batch):
            if self.switches and self._rand() < SWITCH_WINDOW_PROB:
                i, at = self.switches[self._int(len(self.switches))]
                last = min(self.chunks - 1, at + self._int(3))                        # 0..2 chunks after the change
                last = max(last, sink_chunks + recent)
            else:
                i = self._int(len(self.latents))
                last = sink_chunks + recent + self._int(self.chunks - sink_chunks - recent)
            first = last - recent                                                     # first chunk of the stretch
            chunks = list(range(sink_chunks)) + list(range(first, last + 1))
            frames = [c * F_B + f for c in chunks for f in range(F_B)]
            x0.append(self.latents[i][:, frames])
            caps = self.prompts[i, chunks]
            noisy_caps.append(caps[-1:])
            clean_caps.append(self._clean_captions(caps[:-1], int(caps[-1])))
        return torch.stack(x0), [n - 1], torch.stack(clean_caps), torch.stack(noisy_caps)


def flow_loss(model, layout, window, timesteps: torch.Tensor, text, text_bias, g: torch.Generator):
    x0, noisy_chunks, clean_caps, noisy_caps = window
    B = x0.shape[0]
    nn_ = len(noisy_chunks)
    clean = x0[:, :, :clean_caps.shape[1] * F_B]
    if CONTEXT_BLUR_MAX > 0:     # a faded, blurred context (what a few-step sampler's x0 drifts to) -> the true chunk
        mix = torch.rand(B, generator=g) * CONTEXT_BLUR_MAX * (torch.rand(B, generator=g) < CONTEXT_BLUR_PROB)
        blurred = F.avg_pool3d(clean, (1, 3, 3), stride=1, padding=(0, 1, 1), count_include_pad=False)
        clean = clean + mix.view(-1, 1, 1, 1, 1) * (blurred - clean)
    if CONTEXT_AUG_MAX > 0:
        std = torch.rand(B, generator=g) * CONTEXT_AUG_MAX * (torch.rand(B, generator=g) < CONTEXT_AUG_PROB)
        clean = clean + std.view(-1, 1, 1, 1, 1) * torch.randn(clean.shape, generator=g)
    target_x0 = torch.cat([x0[:, :, j * F_B:(j + 1) * F_B] for j in noisy_chunks], dim=2)
    t = timesteps[torch.randint(len(timesteps), (B, nn_), generator=g)]              # (B, nn)
    sigma = (t / 1000).repeat_interleave(F_B, dim=1).view(B, 1, -1, 1, 1)
    noise = torch.randn(target_x0.shape, generator=g)
    xt = (1 - sigma) * target_x0 + sigma * noise
    v = two_stream_forward(model, layout, clean, xt, noisy_chunks, t, text, text_bias, clean_caps, noisy_caps)
    return ((v - (noise - target_x0)) ** 2).mean()
