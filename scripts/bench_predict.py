"""Are the cost model's predictions honest?  Plan estimate vs what XLA compiles.

For tiny presets on a 2x4 ``(data, model)`` CPU mesh and the policies dp / zero3 / megatron / auto,
compile the TRAINING step (``value_and_grad`` of the model's loss wrt the variables, through
``auto_parallel(mesh, policy=P)(module).apply``) and compare:

Memory (per device)
    measured = ``argument + output + temp - alias`` of ``compiled.memory_analysis()``: the
    arguments are the variables (params), the outputs the gradients (+ the scalar loss), temp the
    activations kept for the backward and the transients. A plain grad step holds no optimizer
    state, so it is compared with the cost model's ``memory_breakdown`` *minus* ``optimizer``
    (params + grads + activations + transient). A second figure compiles the full step with an
    ``optax.adam`` update (params and Adam state donated) and compares it with the plan's whole
    ``memory_bytes_per_device`` (``peak``, optimizer state included).

Communication (bytes per device, summed over the step's collectives)
    The plan's ``comm_bytes`` is the sum of the alpha-beta ``n`` of every collective
    (``nnscaler_jax.layout.comm`` / ``nnscaler_jax.mesh.topology``): all_reduce and all_gather: the
    result's local bytes; reduce_scatter: the local bytes *before* the scatter (p x the result);
    all_to_all: p x the local block. ``hlo_collectives`` reports the *result-shape* bytes of each
    HLO collective, so HLO bytes are converted into the ``n`` convention per collective:
    ``n = result_bytes x (p if kind in {reduce_scatter, all_to_all} else 1)`` with ``p`` the
    replica-group size (product of the mesh axes it spans). Also reported: "wire" bytes, what each
    device sends (``mesh.topology.wire_bytes``: all_reduce 2(p-1)/p n, all_gather / reduce_scatter
    (p-1)/p n, ...), on both sides; this is the figure that drives time and it stays comparable
    when XLA picks different collectives than the plan (e.g. all-reduce + slice for a
    reduce-scatter).

Writes ``results/bench_predict.json`` and ``results/bench_predict.md``.
Usage: ``python scripts/bench_predict.py [--quick]`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import os
import tempfile

from _xla_live import dump_flags, peak_kinds

from nnscaler_jax.mesh.cpu import cpu_xla_flags  # starts no JAX backend

# XLA dumps the grad step's buffer live ranges: what is live at its memory peak (by fusion kind);
# reductions fused by XLA as on a GPU, not handed to YNNPACK (nnscaler_jax/mesh/cpu.py)
DUMP = tempfile.mkdtemp(prefix="bench_predict_xla_")
os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", "") + dump_flags(DUMP),
                                        gpu_fusion=True)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import math
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import jax
import optax

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import models
from nnscaler_jax import auto_parallel
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.lower.hlo import hlo_collectives
from nnscaler_jax.mesh.topology import wire_bytes

MEM_TOL = 0.15
COMM_TOL = 0.10
SCALED = {"reduce_scatter", "all_to_all"}  # n = p x the result bytes


def collectives(hlo_text: str, mesh):
    """The collectives of a compiled module (see ``nnscaler_jax.lower.hlo``)."""
    return hlo_collectives(hlo_text, mesh)


def group_size(c, mesh) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    return math.prod(sizes.get(a, 1) for a in c.axes) if "?" not in c.axes else 0


def hlo_n_bytes(cols, mesh) -> tuple[int, float, Counter]:
    """HLO collectives in the cost model's ``n`` convention, their wire bytes, and a summary."""
    n_total, wire, kinds = 0, 0.0, Counter()
    for c in cols:
        p = group_size(c, mesh) or mesh.devices.size
        if p == 1:  # replica groups of one device (XLA leaves some): nothing moves
            kinds[f"{c.kind}[] (size-1 groups, not counted)"] += 1
            continue
        n = c.bytes * (p if c.kind in SCALED else 1)
        n_total += n
        kinds[f"{c.kind}{list(c.axes)}"] += 1
        if c.kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ppermute"):
            wire += wire_bytes(c.kind, p, n) if p > 1 else 0.0
    return n_total, wire, kinds


def plan_wire_bytes(cm: CostModel, plan, graph) -> float:
    """Wire bytes (sent per device) of the plan's collectives: ``plan_cost``'s own walk with each
    path's time replaced by its wire bytes (so multiplicities count)."""
    from nnscaler_jax.cost import plan_walk as cmod
    from nnscaler_jax.layout import comm_path

    def wire_path(src, dst, shape, size, mesh):
        try:
            p = comm_path(src, dst, shape, size, mesh)
        except Exception:  # noqa: BLE001 - unreachable: priced like plan_cost (no bytes)
            return 0.0, 0
        return p.wire_bytes, p.bytes

    saved = cmod.relayout_price
    cmod.relayout_price = wire_path
    try:
        return float(cmod.analyze(cm, plan, graph).comm_time)
    finally:
        cmod.relayout_price = saved


def ratio(pred: float, meas: float) -> float | None:
    return None if not meas else pred / meas


def run_case(name: str, batch: int, policy: str, mesh, with_adam: bool) -> dict:
    spec = models.get(name, "tiny", batch_size=batch)
    args = spec.make_args(abstract=False)
    mutable = list(spec.mutable) if spec.mutable else False
    t0 = time.perf_counter()
    pm = auto_parallel(mesh, policy=policy)(spec.module)
    variables = pm.init(jax.random.key(0), *args)
    plan = pm.plan
    graph = pm.graph

    def loss(v):
        out = pm.apply(v, *args, mutable=mutable)
        if mutable:
            out = out[0]
        return spec.loss_fn(out, *args)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(variables).compile()
    m = compiled.memory_analysis()
    peak = peak_kinds(DUMP)
    measured_mem = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                    - m.alias_size_in_bytes)
    text = compiled.as_text()
    cols = collectives(text, mesh)
    missed = len(cols) - len(hlo_collectives(text, mesh))
    hlo_n, hlo_wire, kinds = hlo_n_bytes(cols, mesh)
    hlo_result = sum(c.bytes for c in cols)

    cm = CostModel.for_axes(dict(plan.mesh), zero=plan.zero)
    bd = cm.memory_breakdown(plan, graph)
    pred_grad_mem = bd["peak"] - bd["optimizer"]
    pred_comm = plan.cost.comm_bytes
    row = {
        "model": name, "batch": batch, "policy": policy, "plan_policy": plan.policy,
        "zero": plan.zero,
        "breakdown": bd,
        "xla_memory": {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
                       "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes},
        "mem_pred_grad_step": pred_grad_mem, "mem_meas_grad_step": measured_mem,
        "mem_ratio": ratio(pred_grad_mem, measured_mem),
        "comm_pred_n": pred_comm, "comm_hlo_result_bytes": hlo_result, "comm_hlo_n": hlo_n,
        "comm_ratio": ratio(pred_comm, hlo_n),
        "comm_pred_wire": plan_wire_bytes(cm, plan, graph), "comm_hlo_wire": hlo_wire,
        "comm_wire_ratio": ratio(plan_wire_bytes(cm, plan, graph), hlo_wire),
        "hlo_collectives": dict(kinds), "hlo_collectives_missed_by_parser": missed,
        "xla_peak_live_by_kind": peak,
    }
    if with_adam:
        opt = optax.adam(1e-3)
        params = variables

        def step(v, s):
            val, g = jax.value_and_grad(loss)(v)
            u, s = opt.update(g, s, v)
            return optax.apply_updates(v, u), s, val

        state = jax.jit(opt.init)(params)
        c2 = jax.jit(step, donate_argnums=(0, 1)).lower(params, state).compile()
        m2 = c2.memory_analysis()
        meas2 = (m2.argument_size_in_bytes + m2.output_size_in_bytes + m2.temp_size_in_bytes
                 - m2.alias_size_in_bytes)
        row.update({"mem_pred_adam_step": bd["peak"], "mem_meas_adam_step": meas2,
                    "mem_adam_ratio": ratio(bd["peak"], meas2),
                    "xla_memory_adam": {"argument": m2.argument_size_in_bytes,
                                        "output": m2.output_size_in_bytes,
                                        "temp": m2.temp_size_in_bytes,
                                        "alias": m2.alias_size_in_bytes}})
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def flag(r: float | None, tol: float) -> str:
    if r is None:
        return "n/a"
    return "ok" if abs(r - 1) <= tol else "OFF"


NOTES = {  # diagnosed by hand (per-path dump of plan_cost vs the HLO collectives), on the figures
    # (plan n, HLO n) given first: a run whose figures differ says the note is stale
    ("gpt", "megatron"): ((110784, 143556),
        ("diagnosed: the data-axis gradient all-reduce agrees to the byte (plan 45248 n vs HLO "
        "45252 incl. the loss scalar) and so do the 4 forward model-axis all-reduces (4 x 8192); "
        "in the backward the plan prices Megatron's f operator once per block input (partial "
        "grads of q, k, v summed locally, then one all-reduce) while GSPMD all-reduces the q, k "
        "and v input-gradients separately (3 x 8192 per attention block): +2 x 2 x 8192 = "
        "32768 B, exactly the gap. XLA's GPU compiler runs AllReduceReassociate in its "
        "collective-optimizations pipeline (add(all-reduce(x), all-reduce(y)) -> "
        "all-reduce(add(x, y))), which gives the plan's one all-reduce; the CPU pipeline "
        "measured here leaves three")),
    ("gpt", "auto"): ((155648, 222624),
        ("diagnosed: every collective of the plan is in the HLO at its size (the forward "
        "all-reduces of the attention output over 'model' and of the MLP output over data x "
        "model as one 8-device all-reduce, their backward counterparts, the all-gathers); the "
        "HLO adds (1) the q / k / v input gradients all-reduced separately where the plan prices "
        "one all-reduce of their sum (2 layers x 2 x 16384 B = 65536 B; XLA's GPU pipeline "
        "reassociates them, as for Megatron above) and (2) 480 + 960 B in the loss outside the "
        "model, whose softmax reduces over the vocab-split logits: 155648 + 65536 + 1440 = "
        "222624 B, the HLO figure")),
}


#: buffer kinds of the CPU backend's own making: convolution operands copied into the layouts
#: its kernels want, (GSPMD) padded copies and materialised broadcasts
BACKEND_COPIES = ("transpose_copy_fusion", "copy_bitcast_fusion", "wrapped_pad",
                  "pad_bitcast_fusion", "wrapped_broadcast", "bitcast_broadcast_fusion")


def _copies(r: dict) -> str:
    kinds = r.get("xla_peak_live_by_kind")
    return "-" if not kinds else str(sum(v for k, v in kinds.items() if k in BACKEND_COPIES))


def _peak_note(r: dict) -> str:
    kinds = r.get("xla_peak_live_by_kind") or {}
    if not kinds:
        return ""
    top = ", ".join(f"{k} {v}" for k, v in list(kinds.items())[:6])
    copies = sum(v for k, v in kinds.items() if k in BACKEND_COPIES)
    return (f". Live at XLA's peak (bytes by kind, from its live-range dump): {top}; of which "
            f"layout copies / pads / materialised broadcasts ({', '.join(BACKEND_COPIES)}): "
            f"{copies} B")


def reasons(r: dict) -> list[str]:
    """Why a case is outside tolerance, from its own figures."""
    out = []
    bd, xm = r["breakdown"], r["xla_memory"]
    if flag(r["mem_ratio"], MEM_TOL) == "OFF":
        act = bd["activations"] + bd["transient"]
        out.append(
            f"memory: activations+transient predicted {act} B vs XLA temp {xm['temp']} B "
            f"(params {bd['params']} vs argument {xm['argument']}, grads {bd['grads']} vs output "
            f"{xm['output']}); " + (
                "the model keeps autodiff's residuals after XLA-style fusion "
                "(nnscaler_jax/cost/residuals.py) plus the largest op output and the gradient "
                "reduction buffer; XLA's buffer assignment also holds several activation "
                "gradients and fusion outputs live at once in the backward, which the model "
                "does not simulate" + _peak_note(r)
                if act < xm["temp"] else
                "the model adds the largest op output and the whole gradient-reduction buffer "
                "on top of the residuals; XLA's buffer assignment overlaps them (reuses "
                "residual buffers once their backward consumer ran)"))
    if flag(r["comm_ratio"], COMM_TOL) == "OFF":
        wr = r.get("comm_wire_ratio")
        msg = (f"comm: plan n {r['comm_pred_n']} vs HLO n {r['comm_hlo_n']}; wire bytes "
               f"{r['comm_pred_wire']:.0f} vs {r['comm_hlo_wire']:.0f} "
               f"(ratio {wr:.3f})" if wr else f"comm: plan n {r['comm_pred_n']} vs HLO n "
               f"{r['comm_hlo_n']}")
        if wr and abs(wr - 1) <= COMM_TOL:
            msg += ("; the plan and XLA pick different collectives (n conventions differ per "
                    "kind) but send the same bytes")
        figures, note = NOTES.get((r["model"], r["policy"]), (None, ""))
        if note and figures != (r["comm_pred_n"], r["comm_hlo_n"]):
            note = (f"a note diagnosed plan n / HLO n {figures[0]} / {figures[1]}; the figures "
                    "changed since, so it no longer applies (re-diagnose)")
        if note:
            msg += "; " + note
        elif not (wr and abs(wr - 1) <= COMM_TOL):
            msg += "; not diagnosed (XLA re-partitions around the plan's layouts)"
        out.append(msg + f"; HLO: {r['hlo_collectives']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="mlp only")
    ap.add_argument("--no-adam", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_predict"))
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    cases = [("mlp", 8), ("gpt", 8), ("wide_resnet", 8)]
    if a.quick:
        cases = cases[:1]
    rows = []
    for name, batch in cases:
        for policy in ("dp", "zero3", "megatron", "auto"):
            try:
                r = run_case(name, batch, policy, mesh, not a.no_adam)
            except Exception as e:  # noqa: BLE001 - report the failure, go on
                r = {"model": name, "batch": batch, "policy": policy,
                     "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items()
                              if k not in ("breakdown", "xla_memory", "xla_memory_adam",
                                           "hlo_collectives")}), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"mesh": {"data": 2, "model": 4}, "backend": jax.default_backend(),
            "jax": jax.__version__, "mem_tol": MEM_TOL, "comm_tol": COMM_TOL}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cases": rows}, indent=1))
    lines = ["# Cost-model predictions vs compiled XLA (tiny presets, 2x4 CPU mesh, training step)",
             "", ("Bytes per device. mem (grad step): plan `memory_breakdown` peak - optimizer vs "
             "XLA argument+output+temp-alias of jit(value_and_grad(loss)); mem (adam): plan peak "
             "vs the step with an optax.adam update (params and state donated). comm: plan "
             "`comm_bytes` (alpha-beta n) vs HLO collectives converted to n (x p for "
             "reduce-scatter / all-to-all); wire: bytes each device sends, both sides. "
             f"Tolerance: memory {MEM_TOL:.0%}, comm {COMM_TOL:.0%}. XLA peak: backend "
             "copies = bytes live at the grad step's memory peak (XLA's live-range dump) in "
             "buffers of the CPU backend's own making, which the cost model does not price: "
             "convolution operands copied into its kernels' layouts, padded copies, "
             "materialised broadcasts (" + ", ".join(BACKEND_COPIES) + ")."), "",
             ("| model | policy | mem pred (grad step) | mem XLA | ratio | | mem pred (adam) | "
             "mem XLA (adam) | ratio | | comm pred n | comm HLO n | ratio | | wire ratio | "
             "XLA peak: backend copies |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['policy']} | error: {r['error'][:80]} |"
                         + " |" * 13)
            continue
        fr = lambda x: "-" if x is None else f"{x:.3f}"
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['mem_pred_grad_step']} | "
            f"{r['mem_meas_grad_step']} | {fr(r['mem_ratio'])} | {flag(r['mem_ratio'], MEM_TOL)} | "
            f"{r.get('mem_pred_adam_step', '-')} | {r.get('mem_meas_adam_step', '-')} | "
            f"{fr(r.get('mem_adam_ratio'))} | {flag(r.get('mem_adam_ratio'), MEM_TOL)} | "
            f"{r['comm_pred_n']} | {r['comm_hlo_n']} | {fr(r['comm_ratio'])} | "
            f"{flag(r['comm_ratio'], COMM_TOL)} | {fr(r.get('comm_wire_ratio'))} | "
            f"{_copies(r)} |")
    lines += ["", "## Outside tolerance, and why", ""]
    for r in rows:
        if "error" not in r:
            lines += [f"- **{r['model']} / {r['policy']}**: {x}" for x in reasons(r)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
