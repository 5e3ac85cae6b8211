"""The compared methods, as the recipe overrides that define them (methods differ only in config)."""

from __future__ import annotations

METHODS: dict[str, list[str]] = {
    # TurnOPD: adaptive rollout depth + progressive turn-normalized loss
    "turnopd": ["depth.mode=adaptive", "loss.mode=progressive"],
    # vanilla OPD: full depth + trajectory-level (token-mean per trajectory) loss
    "vanilla_opd": ["depth.mode=full", "loss.mode=trajectory"],
    # TCOD-F2B: front-to-back depth curriculum + trajectory-level loss
    "tcod": ["depth.mode=curriculum", "loss.mode=trajectory"],
    # ablations
    "adaptive_depth_only": ["depth.mode=adaptive", "loss.mode=trajectory"],
    "progressive_loss_only": ["depth.mode=full", "loss.mode=progressive"],
}


def method_of(depth_mode: str, loss_mode: str) -> str:
    """The method name a (depth mode, loss mode) pair is, or 'depth=<..>,loss=<..>' for other mixes."""
    for name, overrides in METHODS.items():
        if overrides == [f"depth.mode={depth_mode}", f"loss.mode={loss_mode}"]:
            return name
    return f"depth={depth_mode},loss={loss_mode}"
