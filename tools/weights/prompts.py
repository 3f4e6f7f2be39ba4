"""The prompts the trained tiny checkpoints draw (`tiny-latte`, `tiny-skyreels-df`, `tiny-live`): one coloured
object and its motion, ``"a {colour} {shape} {motion}"``.

They were trained on procedural clips of exactly this vocabulary (`tools/weights/clips.py` draws them;
weights/README.md has the recipes), so these 40 prompts are the ones whose videos can be checked for content;
`longserve bench speed` submits them.
"""

from __future__ import annotations

COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("ball", "square")
MOTIONS = ("moving right", "moving left", "moving up", "moving down", "bouncing")

#: name -> RGB in [0, 1]: the colours as the clips drew them
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
}
#: Mid grey is equally far (sqrt(3)/2) from every palette colour, and it is the VAE's 0.
BACKGROUND = (0.5, 0.5, 0.5)

#: All 40 prompts, colour-major: "a red ball moving right", ..., "a yellow square bouncing".
PROMPTS: tuple[str, ...] = tuple(f"a {c} {s} {m}" for c in COLOURS for s in SHAPES for m in MOTIONS)


def parse_prompt(prompt: str) -> tuple[str, str, str]:
    """"a red ball moving right" -> ("red", "ball", "moving right"); ValueError outside the vocabulary."""
    words = prompt.split()
    if len(words) < 4 or words[0] != "a" or words[1] not in COLOURS or words[2] not in SHAPES \
            or " ".join(words[3:]) not in MOTIONS:
        raise ValueError(f"{prompt!r} is not 'a <colour> <shape> <motion>' with colour in {COLOURS}, "
                         f"shape in {SHAPES}, motion in {MOTIONS}")
    return words[1], words[2], " ".join(words[3:])
