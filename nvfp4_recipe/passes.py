"""A format per GEMM pass: the three GEMMs of a linear y = x W^T, their names, and how a config
names a format for some or all of them.

- Fprop (y = x W^T), Dgrad (dx = dY W), Wgrad (dW = dY^T x): `PASSES`. `forward` is Fprop and
  `backward` is Dgrad and Wgrad (`SHORTHANDS`).
- A config value (`precision.format`, each value of `precision.overrides`) is a format name, for
  all three, or a map `{pass or shorthand: format name}` for some of them (`parse_pass_map`).
- `PassFormats`: the three formats one linear runs, as the policy decides them.

No torch: the policy, the TE mapping and the config layer read this without the numerics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable

from .registry import Format, format_names, is_format

PASSES = ("fprop", "dgrad", "wgrad")
SHORTHANDS = {"forward": ("fprop",), "backward": ("dgrad", "wgrad")}
PASS_NAMES = "fprop, dgrad, wgrad, forward (= fprop), backward (= dgrad + wgrad)"
BF16 = str(Format.bf16)


class PassFormats(str):
    """The format of each GEMM of one linear: `.fprop`, `.dgrad`, `.wgrad` (format names).

    As a string it is the format's name where the three agree ("nvfp4") and "fprop/dgrad/wgrad"
    where they do not ("mxfp8/nvfp4/nvfp4"), the notation of the precision map; so code that
    reads one format per linear (`fmt != "bf16"`, a dict keyed by format, plan.json) keeps working
    for the linears that have one, and `PassFormats(str(p)) == p` (also how it pickles).
    """

    fprop: str
    dgrad: str
    wgrad: str

    def __new__(cls, fprop: str, dgrad: str | None = None, wgrad: str | None = None):
        if dgrad is None and wgrad is None:
            parts = str(fprop).split("/")
            if len(parts) == 1:
                parts *= 3
            elif len(parts) != 3:
                raise ValueError(f"{fprop!r}: a format name or fprop/dgrad/wgrad formats")
        elif dgrad is None or wgrad is None:
            raise ValueError("PassFormats takes one format or all three (fprop, dgrad, wgrad)")
        else:
            parts = [fprop, dgrad, wgrad]
        for part in parts:
            if not is_format(part):
                raise ValueError(f"unknown GEMM format {part!r}: choose one of {format_names()}")
        parts = [str(Format(part)) for part in parts]
        text = parts[0] if parts[0] == parts[1] == parts[2] else "/".join(parts)
        self = super().__new__(cls, text)
        self.fprop, self.dgrad, self.wgrad = parts
        return self

    def __repr__(self) -> str:
        return f"PassFormats({str(self)!r})"

    @property
    def formats(self) -> tuple[str, str, str]:
        """(fprop, dgrad, wgrad)."""
        return self.fprop, self.dgrad, self.wgrad

    @property
    def uniform(self) -> str | None:
        """The one format of all three GEMMs, or None where they differ."""
        return self.fprop if self.fprop == self.dgrad == self.wgrad else None

    @property
    def low_precision(self) -> bool:
        """Whether any GEMM is quantized."""
        return any(f != BF16 for f in self.formats)

    def quantized_formats(self) -> list[str]:
        """The low-precision formats among the three, each once, in pass order."""
        return list(dict.fromkeys(f for f in self.formats if f != BF16))

    def replace(self, formats: Mapping[str, str]) -> "PassFormats":
        """These formats with some passes changed ({pass: format}, as `parse_pass_map` gives)."""
        merged = dict(zip(PASSES, self.formats))
        for name, fmt in formats.items():
            if name not in merged:
                raise ValueError(f"{name!r} is not a GEMM pass: use one of {', '.join(PASSES)}")
            merged[name] = fmt
        return PassFormats(*(merged[p] for p in PASSES))

    def with_bf16(self, passes: Iterable[str]) -> "PassFormats":
        """These formats with `passes` in BF16 (what the late switch to BF16 does)."""
        return self.replace(dict.fromkeys(passes, BF16))


ALL_BF16 = PassFormats(BF16)


def parse_pass_map(value: Any, key: str) -> dict[str, str]:
    """{pass: format} that a config value names: a format name gives all three passes, a map
    the passes it names (`forward` / `backward` stand for theirs). ValueError naming `key` and
    the allowed values for an unknown format or pass, a pass named twice, or an empty map."""
    if isinstance(value, str):
        if not is_format(value):
            raise ValueError(f"{key}={value!r}: choose one of {format_names()}, or a map "
                             f"{{pass: format}} with passes {PASS_NAMES}")
        return dict.fromkeys(PASSES, str(Format(value)))
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}={value!r}: a format ({format_names()}) or a map "
                         f"{{pass: format}} with passes {PASS_NAMES}")
    if not value:
        raise ValueError(f"{key}={{}} names no GEMM pass: give a format ({format_names()}) or "
                         f"a map {{pass: format}} with passes {PASS_NAMES}")
    named: dict[str, tuple[str, str]] = {}  # pass -> (the key that named it, its format)
    for name, fmt in value.items():
        passes = SHORTHANDS.get(name, (name,) if name in PASSES else None)
        if passes is None:
            raise ValueError(f"{key}: {name!r} is not a GEMM pass; use {PASS_NAMES}")
        if not isinstance(fmt, str) or not is_format(fmt):
            raise ValueError(f"{key}.{name}={fmt!r}: choose one of {format_names()}")
        for p in passes:
            if p in named:
                raise ValueError(f"{key}: {named[p][0]!r} and {name!r} both name {p}; name "
                                 "each pass once")
            named[p] = (name, str(Format(fmt)))
    return {p: named[p][1] for p in PASSES if p in named}


def pass_formats(value: Any, key: str, base: PassFormats = ALL_BF16) -> PassFormats:
    """The formats a config value gives a linear whose formats are `base` without it: the passes
    the value names take its formats, the others keep `base`'s."""
    return base.replace(parse_pass_map(value, key))
