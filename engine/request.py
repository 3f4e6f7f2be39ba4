"""A video request as plain data (it travels to the workers), and the error that blames its input.

`GenerationSpec` holds what every model family understands (prompts, frames, size, steps,
guidance, seed, what to return, the LoRA adapters of the request); `options` holds what only some families understand
(Wan 2.2's `guidance_scale_2`, diffusion forcing's `base_num_frames`, ...). A family's
`check_request` validates a spec on the coordinator, before any worker sees it, and
raises `RequestError` naming the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OUTPUTS = ("np", "uint8", "latent")


class RequestError(ValueError):
    """The request's input is invalid: the caller's fault (HTTP 4xx), raised before any worker ran.

    `field` names the argument at fault ("num_frames", "size", "ar_step", ...).
    """

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class GenerationSpec:
    """One request. `prompt` is a list (one video per prompt); frames/size are in pixels.

    output: "np" -> float32 (B, n, H, W, 3) in [0, 1] per decoded chunk (diffusers' output_type="np");
            "uint8" -> the same pixels quantized as an MP4 writer wants them, round(x * 255);
            "latent" -> the final latents, in one chunk.
    decode_chunk_size: frames one worker pushes through the VAE at once (bounds its memory).
    lora: the adapters loaded at start that this request applies, [{"name", "scale"}, ...] once checked
          (`engine/lora.py`; the engine checks it, whatever the family).
    """

    request_id: str
    prompt: list[str]
    negative_prompt: list[str] | str
    num_frames: int
    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    output: str = "np"
    decode_chunk_size: int = 8
    options: dict = field(default_factory=dict)
    lora: list = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.prompt)

    @property
    def use_cfg(self) -> bool:
        return self.guidance_scale > 1.0

    def params(self) -> dict:
        """The generation parameters of a one-prompt request as plain data (what the server stores)."""
        return {"num_frames": self.num_frames, "height": self.height, "width": self.width,
                "num_inference_steps": self.num_inference_steps, "guidance_scale": self.guidance_scale,
                "seed": self.seed, "negative_prompt": self.negative_prompt, "options": dict(self.options),
                "lora": [dict(e) for e in self.lora or []]}

    @classmethod
    def from_params(cls, request_id: str, prompt: str, params: dict, output: str = "uint8") -> "GenerationSpec":
        """The inverse of `params` (extra keys, such as the server's fps, are ignored)."""
        return cls(request_id=request_id, prompt=[prompt], negative_prompt=params["negative_prompt"],
                   num_frames=params["num_frames"], height=params["height"], width=params["width"],
                   num_inference_steps=params["num_inference_steps"], guidance_scale=params["guidance_scale"],
                   seed=params["seed"], output=output, options=dict(params.get("options") or {}),
                   lora=list(params.get("lora") or []))

    def negative_prompts(self) -> list[str]:
        """One negative prompt per prompt."""
        if isinstance(self.negative_prompt, str):
            return [self.negative_prompt] * self.batch_size
        return list(self.negative_prompt)
