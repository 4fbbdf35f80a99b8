"""Two runs side by side: where their data, weights and losses first differ, how far
apart they drift, and whether that is within tolerance.

The comparison is void (it says so and exits 3) when the runs did not train on the
same data (a batch digest differs) or did not start from the same weights (the
parameter digest of their first common step differs): a loss gap then says nothing
about the layout or the vendor.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

from hetjax.errors import ConfigError
from hetjax.repro.record import read

# Tolerances for runs that are expected to be close but not identical (other layouts,
# other vendors); see README "Reproducibility" for how they were chosen.
LOSS_RTOL = 1e-4  # largest |loss_a - loss_b| / |loss_a| over the compared steps
NORM_RTOL = 1e-4  # largest relative gap of any tensor's L2 norm at a common params step

OK, OUT_OF_TOLERANCE, VOID = 0, 1, 3  # exit codes


@dataclasses.dataclass
class Report:
    a: str
    b: str
    steps: list[int]  # steps both runs recorded
    lacking: tuple[list[int], list[int]]  # steps the other run recorded and A (B) lacks inside its span
    ends: tuple[int | None, int | None]  # the last step each run recorded
    planned: tuple[int | None, int | None]  # config.steps each run ended with
    first_data_diff: int | None
    init_step: int | None  # the first params step both recorded
    init_equal: bool | None
    first_loss_diff: int | None
    first_grad_norm_diff: int | None
    max_loss_gap: float  # relative
    max_loss_gap_step: int | None
    norm_step: int | None  # the last params step both recorded
    norm_drift: dict[str, float]  # tensor -> relative norm gap at norm_step
    digests_equal: list[int]  # params steps whose digests agree bit for bit
    digests_differ: list[int]
    config_diff: dict[str, tuple]
    platforms: tuple[str, str]
    rtol: float
    norm_rtol: float

    @property
    def void(self) -> str | None:
        if not self.steps:
            return "the runs have no step in common"
        if self.first_data_diff is not None:
            return (f"the data differ from step {self.first_data_diff} (batch digests differ): the runs "
                    f"did not train on the same tokens, so their losses cannot be compared")
        if self.init_equal is False:
            return (f"the parameters differ at step {self.init_step}, the first step both recorded: the runs "
                    f"did not start from the same weights; start both from one checkpoint "
                    f"(--config.init_from=DIR)")
        if self.ends[0] != self.ends[1]:
            short = 0 if self.ends[0] < self.ends[1] else 1
            if all(p is not None and e + 1 == p for e, p in zip(self.ends, self.planned)):
                # Both finished: neither stopped early, their configs asked for different lengths.
                return (f"config.steps differs: run A trains {self.planned[0]} steps, run B {self.planned[1]}, "
                        f"and both finished; the steps only run {'AB'[1 - short]} has cannot be judged; "
                        f"compare runs with the same config.steps")
            name, other = "AB"[short], "AB"[1 - short]
            return (f"run {name} ends at step {self.ends[short]} (its config trains {self.planned[short]}), run {other} at step "
                    f"{self.ends[1 - short]}: {name} stopped early (killed, diverged) or is still running, and "
                    f"the steps it lacks cannot be judged; compare runs that reached the same step")
        for name, lacks in zip("AB", self.lacking):
            if lacks:  # a damaged or edited file: 2 steps of 20 compared read as BIT-IDENTICAL
                return (f"run {name} has no fingerprint for steps {_spans(lacks)}, which the other run has: its "
                        f"fingerprints file is damaged or was edited, and those steps cannot be judged")
        return None

    @property
    def identical(self) -> bool:
        return (self.void is None and self.first_loss_diff is None and self.first_grad_norm_diff is None
                and not self.digests_differ)

    @property
    def max_norm_drift(self) -> float:
        return max(self.norm_drift.values(), default=0.0)

    @property
    def within(self) -> bool:
        return self.max_loss_gap <= self.rtol and self.max_norm_drift <= self.norm_rtol

    @property
    def code(self) -> int:
        return VOID if self.void else OK if self.within else OUT_OF_TOLERANCE

    @property
    def verdict(self) -> str:
        if self.void:
            return "VOID: " + self.void
        if self.identical:
            return "BIT-IDENTICAL: every loss, gradient norm and parameter digest agrees"
        word = "WITHIN TOLERANCE" if self.within else "OUT OF TOLERANCE"
        return (f"{word}: max relative loss gap {self.max_loss_gap:.3g} (rtol {self.rtol:g}), max "
                f"relative norm drift {self.max_norm_drift:.3g} (norm_rtol {self.norm_rtol:g})")


def check_tolerances(rtol: float, norm_rtol: float, names=("rtol", "norm_rtol")) -> None:
    """A NaN tolerance fails every comparison but the bit-identical one, whose verdict then
    read BIT-IDENTICAL beside exit 1; a negative one fails all; inf passes anything."""
    for name, value in zip(names, (rtol, norm_rtol)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name}={value}: a tolerance is a finite relative gap, at least 0 "
                              f"(0: bit-identical), e.g. {name}={LOSS_RTOL:g}")


def _same(a: float, b: float) -> bool:
    """Equal, with NaN equal to NaN: a reproduced divergence is reproduced."""
    return a == b or (math.isnan(a) and math.isnan(b))


def _rel(a: float, b: float) -> float:
    """The relative gap; inf where only one side is finite (max() would skip a NaN)."""
    if _same(a, b):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = json_value(v)
    return out


def json_value(v):
    return tuple(map(json_value, v)) if isinstance(v, list) else v


# Fields that say where and how a run ran, or what it is called and traced, not what it trained.
_LAYOUT_KEYS = ("run_dir", "mesh.", "compile.", "checkpoint.", "pipeline.", "sharding.", "hetero.", "tensorboard",
                "log_every", "eval_", "fingerprint_every", "device_memory_gib", "memory_fraction",
                "peak_tflops", "data.num_workers", "init_from", "profile_steps", "wandb.")
_BOOKKEEPING_KEYS = ("name",)  # whole keys: a prefix "name" would hide any later name_* field


def config_diff(a: dict, b: dict) -> dict[str, tuple]:
    """Config fields (other than layout and bookkeeping) whose values differ."""
    fa, fb = _flat(a), _flat(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb))
            if fa.get(k) != fb.get(k) and not k.startswith(_LAYOUT_KEYS) and k not in _BOOKKEEPING_KEYS}


def _layout_words(header: dict) -> str:
    """'mesh fsdp=8', or an islands job's islands from its config (it records no one mesh:
    each island has its own, so an empty mesh there is not one device)."""
    islands = header.get("config", {}).get("hetero", {}).get("islands") or []
    if not header.get("mesh") and islands:
        sizes = lambda m: ",".join(f"{k}={v}" for k, v in (m or {}).items() if v != 1) or "one device"  # noqa: E731
        return "islands " + " + ".join(f"{i.get('name', '?')} ({i.get('platform', '?')}, mesh {sizes(i.get('mesh'))})"
                                       for i in islands)
    return "mesh " + (",".join(f"{k}={v}" for k, v in header.get("mesh", {}).items() if v != 1) or "one device")


def compare(run_a: str | Path, run_b: str | Path, rtol: float = LOSS_RTOL,
            norm_rtol: float = NORM_RTOL) -> Report:
    """Compares the fingerprints of two run directories."""
    check_tolerances(rtol, norm_rtol)
    ha, sa, pa = read(run_a)
    hb, sb, pb = read(run_b)
    steps = sorted(set(sa) & set(sb))
    first = lambda pred: next((s for s in steps if pred(s)), None)  # noqa: E731
    first_data = first(lambda s: sa[s]["batch"] != sb[s]["batch"])
    first_loss = first(lambda s: not _same(sa[s]["loss"], sb[s]["loss"]))
    first_gn = first(lambda s: not _same(sa[s]["grad_norm"], sb[s]["grad_norm"]))
    gaps = {s: _rel(sa[s]["loss"], sb[s]["loss"]) for s in steps}
    worst = max(gaps, key=gaps.get, default=None)
    pboth = sorted(set(pa) & set(pb))
    init = pboth[0] if pboth else None
    norm_step = pboth[-1] if pboth else None
    drift = {}
    if norm_step is not None:
        na, nb = pa[norm_step]["norms"], pb[norm_step]["norms"]
        drift = {k: _rel(na[k], nb[k]) if k in nb else math.inf for k in na}
        drift.update({k: math.inf for k in nb if k not in na})
    # The config each run ended with: a run resumed with other settings has a header per start.
    cfg_a = ha[-1].get("config", {}) if ha else {}
    cfg_b = hb[-1].get("config", {}) if hb else {}
    where = lambda h: " + ".join(  # noqa: E731
        f"{x['platform']} ({x['device_kind']}, jax {x['jax']}, {x['profile']}, {_layout_words(x)})"
        for x in h) or "?"
    return Report(
        a=str(run_a), b=str(run_b), steps=steps, lacking=(_gaps(sa, sb), _gaps(sb, sa)),
        first_data_diff=first_data, init_step=init,
        init_equal=None if init is None else pa[init]["params"] == pb[init]["params"],
        first_loss_diff=first_loss, first_grad_norm_diff=first_gn,
        max_loss_gap=gaps.get(worst, 0.0) if worst is not None else 0.0, max_loss_gap_step=worst,
        norm_step=norm_step, norm_drift=drift,
        digests_equal=[s for s in pboth if pa[s]["params"] == pb[s]["params"]],
        digests_differ=[s for s in pboth if pa[s]["params"] != pb[s]["params"]],
        config_diff=config_diff(cfg_a, cfg_b), platforms=(where(ha), where(hb)),
        ends=(max(sa, default=None), max(sb, default=None)),
        planned=(cfg_a.get("steps"), cfg_b.get("steps")), rtol=rtol, norm_rtol=norm_rtol)


def _gaps(own: dict, other: dict) -> list[int]:
    """The steps `other` recorded that `own` lacks inside its own first..last (a run that
    started later, from init_from or another checkpoint, lacks the steps before it)."""
    return sorted(s for s in set(other) - set(own) if min(own, default=0) <= s <= max(own, default=-1))


def _spans(steps: list[int]) -> str:
    """[3, 4, 5, 9] -> '3..5, 9'."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in spans)


def describe(r: Report, top: int = 5) -> str:
    """The report as text, for a terminal."""
    lines = [f"A: {r.a}  on {r.platforms[0]}", f"B: {r.b}  on {r.platforms[1]}"]
    for k, (va, vb) in r.config_diff.items():
        lines.append(f"config differs: {k} = {va!r} (A) vs {vb!r} (B)")
    if r.steps:
        lines.append(f"steps compared: {r.steps[0]}..{r.steps[-1]} ({len(r.steps)})")
    for name, end, planned in zip("AB", r.ends, r.planned):
        if end is not None and planned is not None and end + 1 < planned:
            lines.append(f"run {name} ends at step {end}, short of its config.steps={planned}")
    lines.append("data: " + ("identical batches at every step" if r.first_data_diff is None
                             else f"FIRST DIFFERS AT STEP {r.first_data_diff}"))
    if r.init_step is not None:
        lines.append(f"parameters at step {r.init_step}: " + ("identical" if r.init_equal else "DIFFER"))
    if not r.void:
        lines.append("loss: " + ("bit-identical at every step" if r.first_loss_diff is None
                                 else f"first differs at step {r.first_loss_diff}"))
        lines.append("grad_norm: " + ("bit-identical at every step" if r.first_grad_norm_diff is None
                                      else f"first differs at step {r.first_grad_norm_diff}"))
        lines.append(f"largest relative loss gap: {r.max_loss_gap:.3g}"
                     + (f" at step {r.max_loss_gap_step}" if r.max_loss_gap else ""))
        if r.digests_equal or r.digests_differ:
            lines.append(f"parameter digests equal at steps {r.digests_equal or 'none'}"
                         + (f", differ at {r.digests_differ}" if r.digests_differ else ""))
        if r.norm_drift:
            worst = sorted(r.norm_drift.items(), key=lambda kv: -kv[1])[:top]
            lines.append(f"per-tensor norm drift at step {r.norm_step} (relative; largest {len(worst)}):")
            lines += [f"  {k:<32} {v:.3g}" for k, v in worst]
    lines.append(r.verdict)
    return "\n".join(lines)


def plot_or_say_why_not(run_a: str | Path, run_b: str | Path, path: str | Path, echo=print) -> None:
    """Draws plot(); when it cannot (no matplotlib, an unwritable path) says why instead:
    the verdict stands without its picture, and so does its exit code."""
    from hetjax import cli
    try:
        cli.need("matplotlib", "plot", "the comparison's plot")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        echo(f"plot: {plot(run_a, run_b, path)}")
    except (ConfigError, OSError) as e:
        print(f"no plot: {e}", file=sys.stderr, flush=True)


def plot(run_a: str | Path, run_b: str | Path, path: str | Path) -> Path:
    """A PNG of both loss curves (top) and their relative gap (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    _, sa, _ = read(run_a)
    _, sb, _ = read(run_b)
    steps = sorted(set(sa) & set(sb))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    top.plot(sorted(sa), [sa[s]["loss"] for s in sorted(sa)], label=f"A: {Path(run_a).name}")
    top.plot(sorted(sb), [sb[s]["loss"] for s in sorted(sb)], "--", label=f"B: {Path(run_b).name}")
    top.set_ylabel("loss")
    top.legend()
    gap = [_rel(sa[s]["loss"], sb[s]["loss"]) for s in steps]
    bottom.plot(steps, gap, ".-", color="C3")
    if any(gap):
        bottom.set_yscale("symlog", linthresh=min(g for g in gap if g > 0))
    bottom.set_ylabel("|A-B| / |A|")
    bottom.set_xlabel("step")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
