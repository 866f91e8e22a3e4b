"""What a Triton kernel was declared with, whether Triton compiles it (`JITFunction`) or
interprets it on the CPU (`TRITON_INTERPRET=1`: `InterpretedFunction`, which keeps its
keyword arguments)."""

from __future__ import annotations

from typing import Any


def unspecialized(kernel: Any) -> set[str]:
    """The parameters the kernel is not specialised on (`do_not_specialize`), by name."""
    declared = getattr(kernel, "do_not_specialize", None)
    if declared is None:
        declared = kernel.kwargs.get("do_not_specialize") or ()
    names = list(getattr(kernel, "arg_names", None) or [p.name for p in kernel.params])
    return {names[d] if isinstance(d, int) else d for d in declared}
