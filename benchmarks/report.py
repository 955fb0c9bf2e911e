"""Turning a results dict into the markdown tables printed on stdout and a PNG plot.

Owns: presentation only (tables, target verdicts, the figure). Must not touch:
measuring anything. The same tables are pasted into benchmarks/README.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

# Targets from issue #5 (#19: bucketed at least as fast as torch DDP): (what, value getter, limit, "<=" or ">=").
TARGETS = [
    # Judged over separate launches (strategies' `parity`, with an identical torch DDP as the
    # control): one launch biases a comparison by several % here, whatever its rounds.
    ("bucketed / torch DDP step time, over launches (MLP)",
     lambda r: r["strategies"]["mlp"]["parity"]["ratio"], 1.00, "<="),
    ("bucketed / torch DDP step time, over launches (GPT)",
     lambda r: r["strategies"]["gpt"]["parity"]["ratio"], 1.00, "<="),
    ("bucketed / native wrapper (MLP)", lambda r: r["strategies"]["mlp"]["ratios"]["bucketed_over_native"], 1.05, "<="),
    ("Ray Train / plain torch.distributed step", lambda r: r["ray_overhead"]["ray_over_plain"], 1.05, "<="),
    # issue #12: asynchronous upload keeps a quickstart checkpoint from stalling training
    ("quickstart checkpoint blocks the step loop (s, async upload)",
     lambda r: r["checkpoint"]["states"]["quickstart"]["async"]["median"], 0.05, "<="),
    ("max comm bytes / theoretical minimum", lambda r: max(x["bytes_over_min"] for x in r["accumulation"]["rows"]), 1.0, "=="),
    ("calls on non-final micro-steps", lambda r: sum(x["nonfinal_calls"] for x in r["accumulation"]["rows"]), 0, "=="),
    # issue #16: the sharded strategies keep 1/W of the optimizer state, send gradient + parameter bytes
    ("zero1/fsdp optimizer state per rank x W / bucketed's, max deviation",
     lambda r: max(abs(s["optimizer_share_of_bucketed"] * r["memory"]["world_size"] - 1)
                   for m in ("mlp", "gpt") if m in r["memory"]
                   for k, s in r["memory"][m]["strategies"].items() if k != "bucketed"), 0.01, "<="),
    ("zero1 bytes per step / (gradient + parameter bytes)",
     lambda r: max((r["memory"][m]["strategies"]["zero1"]["wire"]["grad_sync_over_grad_bytes"]
                    + r["memory"][m]["strategies"]["zero1"]["wire"]["all_gather_over_param_bytes"]) / 2
                   for m in ("mlp", "gpt") if m in r["memory"]), 1.001, "<="),
    ("data wait / step time (training run)", lambda r: r["ingest"]["data_wait_fraction"], 0.10, "<="),
    # issue #15: a SIGKILLed worker costs at most the step in flight, back to training fast, replica cheap to keep
    ("completed steps redone after a worker SIGKILL (run.recovery=replica)",
     lambda r: r["recovery"]["kill"]["replica"]["steps_redone_max"], 1, "<="),
    ("s from a worker SIGKILL to the next trained step (replica, worst run)",
     lambda r: r["recovery"]["kill"]["replica"]["kill_to_next_step_s"]["max"], 10.0, "<="),
    # issue #28: run.recovery=live keeps the survivors' processes and is back in seconds
    ("s from a worker SIGKILL to the next trained step (live, median of runs)",
     lambda r: r["recovery"]["kill"]["live"]["kill_to_next_step_s"]["median"], 5.0, "<="),
    ("completed steps redone after a worker SIGKILL (live)",
     lambda r: r["recovery"]["kill"]["live"]["steps_redone_max"], 0, "<="),
    ("survivors keep their processes (live, every run: 1 = yes)",
     lambda r: float(r["recovery"]["kill"]["live"]["survivors_kept_all"]
                     and bool(r["recovery"]["kill"]["live"]["runs"])),
     1.0, "=="),
    ("live's step time over replica's, no failure (median of paired runs, %)",
     lambda r: r["recovery"]["kill"]["live_overhead_pct"], 2.0, "<="),
    ("completed steps redone after a node loss", lambda r: r["recovery"]["node_loss"]["steps_redone"], 1, "<="),
    ("s from a node loss to the next trained step", lambda r: r["recovery"]["node_loss"]["kill_to_next_step_s"],
     20.0, "<="),
    ("s from a node loss to the next trained step (live)",
     lambda r: r["recovery"]["node_loss_live"]["kill_to_next_step"]["median"], 15.0, "<="),
    ("replica's cost per step, % of step time (quickstart)",
     lambda r: r["recovery"]["overhead"]["quickstart"]["overhead_pct"], 3.0, "<="),
    ("replica's cost per step, % of step time (>= 100 MB state)",
     lambda r: r["recovery"]["overhead"]["large"]["overhead_pct"], 3.0, "<="),
    # issue #14: data.sharding=sharded's default batch path keeps up with the in-memory gather
    ("sharded / in-memory samples/s (default: inline while reads are quick)",
     lambda r: r["ingest"]["sharded_over_in_memory"], 0.9, ">="),
    ("sharded: an epoch's first batch, pipeline warm (s)", lambda r: r["ingest"]["sharded_first_batch_s"], 0.5, "<="),
    # issue #55: compile is never a trap; activation checkpointing halves the memory for little time
    ("native: compiled step / eager step (gpt preset)",
     lambda r: next(x["compiled_over_eager"] for x in r["compile"]["rows"] if x["strategy"] == "native"), 1.05, "<="),
    ("activation checkpointing: memory with / without (gpt preset)",
     lambda r: r["activation_checkpointing"]["memory_ratio"], 0.6, "<="),
    ("activation checkpointing: step time with / without (gpt preset)",
     lambda r: r["activation_checkpointing"]["step_ratio"], 1.4, "<="),
    ("run.validation=async: the loop's stall per validation / a steady step",
     lambda r: r["validation"]["async"]["stall_over_step"], 2.0, "<="),
]


def _f(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:,.{digits}f}"
    return str(value)


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for what, get, limit, op in TARGETS:
        try:
            value = get(results)
        except (KeyError, TypeError, ValueError):
            continue
        met = {"<=": value <= limit + 1e-12, ">=": value >= limit - 1e-12, "==": abs(value - limit) <= 1e-9}[op]
        rows.append({"target": what, "value": value, "limit": f"{op} {limit}", "met": bool(met)})
    return rows


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_f(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _parity_lines(strat: dict[str, Any], models: list[str]) -> list[str]:
    """#19's launches: bucketed_25mb (and over gloo) / torch_ddp and the control, with their intervals."""
    rows = []
    for m in models:
        p = strat[m].get("parity")
        if p:
            gloo = ([_f(p["gloo"], 3), "-".join(_f(v, 3) for v in p["gloo_ci95"])] if "gloo" in p else ["-", "-"])
            rows.append([m, _f(p["ratio"], 3), "-".join(_f(v, 3) for v in p["ci95"]), *gloo,
                         _f(p["control"], 3), "-".join(_f(v, 3) for v in p["control_ci95"]),
                         " ".join(_f(v, 3) for v in p["per_launch"]),
                         f"{p['launches']} x {p['rounds_per_launch']}"])
    if not rows:
        return []
    return ["\n**bucketed / torch DDP over separate launches** (#19; each launch: bucketed_25mb as configured "
            "by default (shared memory between ranks on one host), the same over gloo, torch_ddp and an identical "
            "torch_ddp, the control, in rotated rounds; per launch the paired ratio against torch_ddp; geometric "
            "mean over launches, 95 % t interval)\n",
            _table(["model", "bucketed / torch DDP", "95 % interval", "bucketed over gloo / torch DDP",
                    "gloo interval", "control / torch DDP", "control interval", "bucketed per launch",
                    "launches x rounds"], rows)]


def _comm_tables(strat: dict[str, Any], models: list[str]) -> list[str]:
    """Exposed communication per variant (from the wrappers' comm_stats) and the auto choice."""
    labels = [label for label in strat[models[0]]["step_ms"] if any(label in strat[m].get("comm", {}) for m in models)]
    if not labels:
        return []
    out = ["\n**Exposed communication** (per step, mean over ranks: ms with a gradient all-reduce in "
           "flight / ms of it after backward had finished / fraction backward hid; torch DDP has no counter)\n"]
    rows = []
    for label in labels:
        row = [label]
        for m in models:
            c = strat[m].get("comm", {}).get(label)
            row.append("n/a" if c is None else
                       f"{c['comm_ms']:.2f} / {c['exposed_ms']:.2f} / {_f(c['overlap_fraction'], 2)}")
        rows.append(row)
    out.append(_table(["variant"] + [f"{m}: comm / exposed ms / hidden" for m in models], rows))
    for m in models:
        if strat[m].get("auto"):
            out.append(f"\n`bucketed_auto` on {m}: {strat[m]['auto']['text']}")
    return out


def _memory_tables(mem: dict[str, Any]) -> list[str]:
    """Per strategy: bytes per rank, wire bytes per step against theory, step time, what fits."""
    out = [f"\n**Memory per rank and step time** ({mem['world_size']} ranks, {mem['optimizer']} "
           f"{mem['dtype']}, {mem['micro_steps']} micro-steps per step; {mem['note']})\n"]
    rows = []
    for m in (k for k in ("mlp", "gpt") if k in mem):
        for strategy, s in mem[m]["strategies"].items():
            b, w, t = s["bytes_per_rank"], s["wire"], s["step_ms"]
            rows.append([f"{m} ({mem[m]['params'] / 1e6:.2f} M)", strategy,
                         *(f"{b[part] / 2**20:.2f}" for part in ("params", "grads", "optimizer")),
                         f"{s['total_mb']:.2f}", _f(s["optimizer_share_of_bucketed"], 4),
                         _f(w["grad_sync_over_grad_bytes"], 4), _f(w["all_gather_over_param_bytes"], 4),
                         f"{t['median']:.1f} [{t['p25']:.1f}-{t['p75']:.1f}]",
                         f"{s['fits_params'] / 1e9:.1f} B"])
    out.append(_table(["model", "strategy", "params MB", "grads MB", "optimizer MB", "total MB",
                       "optimizer / bucketed's", "grad-sync bytes / grad bytes",
                       "all-gather bytes / param bytes", "step ms (median [p25-p75])",
                       f"fits {mem['fit_device_gb']} GB x {mem['fit_workers']} workers (params)"], rows))
    return out


def _recovery_tables(rec: dict[str, Any]) -> list[str]:
    """A SIGKILLed worker per run.recovery mode, side by side, and the replica's per-step cost (#15, #28)."""
    out = []
    kill = rec.get("kill")
    if kill and "modes" in kill:
        from benchmarks.live_recovery import table

        out.append(f"\n**Recovery from a SIGKILLed worker: run.recovery side by side** ({kill['world_size']} workers, "
                   f"quickstart, {kill['max_steps']} steps, durable checkpoints every "
                   f"{kill['checkpoint_every_steps']} steps, rank 1 killed once step {kill['kill_at']} was logged; "
                   "the modes interleaved in one invocation)\n")
        out += table(kill)
        rows = []
        for mode in kill["modes"]:
            for r in kill[mode]["runs"]:
                t = r.get("newcomer") or {}
                rows.append([mode, r["killed_rank"], r["last_step_before_kill"], r.get("resumed_from") or "-",
                             "-" if r.get("resumed_step") is None else r["resumed_step"], r["steps_redone"],
                             "-" if r.get("kill_to_copy_s") is None else _f(r["kill_to_copy_s"], 2),
                             "-" if r.get("kill_to_restart_s") is None else _f(r["kill_to_restart_s"], 1),
                             "-" if t.get("function_s") is None else _f(t["function_s"], 2),
                             "-" if t.get("group_s") is None else _f(t["group_s"], 2),
                             "-" if t.get("loaded_s") is None else _f(t["loaded_s"], 2),
                             _f(r["kill_to_next_step_s"], 1), _f(r.get("load_avg", [math.nan])[0], 1)])
        out.append("\nOne row per run (live: when the newcomer's training function started, torchft was up in it "
                   "and its state was loaded, each in s from the kill):\n")
        out.append(_table(["run.recovery", "killed rank", "last step before the kill", "resumed from",
                           "resumed at step", "completed steps redone", "kill -> survivor's copy (s)",
                           "kill -> new group (s)", "newcomer function (s)", "newcomer torchft (s)",
                           "newcomer loaded (s)", "kill -> next trained step (s)", "load"], rows))
    elif rec.get("kill_note"):
        out.append(f"\n**Recovery from a SIGKILLed worker**: {rec['kill_note']}")
    for key, what in (("node_loss", "run.recovery=replica, 1-2 workers of 2 CPUs"),
                      ("node_loss_live", "run.recovery=live, 2 workers of 1 CPU spread over the nodes")):
        node = rec.get(key)
        if not node or "error" in node:
            continue
        out.append(f"\n**A whole node lost** (two-node local cluster, tiny config, {what}; every process of the "
                   "second node SIGKILLed mid-run)\n")
        out.append(_table(["last step before the kill", "went on from", "at step", "completed steps redone",
                           "workers before -> after", "kill -> next trained step (s)", "load"],
                          [[r["last_step_before_kill"], r["resumed_from"], r["resumed_step"], r["steps_redone"],
                            " -> ".join(map(str, r["world_sizes"])), _f(r["kill_to_next_step_s"], 1),
                            _f(r.get("load_avg", [math.nan])[0], 1)] for r in node.get("runs", [node])]))
    ov = rec["overhead"]
    out.append(f"\n**Keeping the replica: `LastStep.mark()` at every step boundary** (1 process, 1 thread, "
               f"no Ray; medians over {ov['rounds']} interleaved rounds with and without it)\n")
    rows = [[name, _f(o["state_mb"], 1), _f(o["step_ms"], 2), _f(o["mark_ms"], 3), _f(o["overhead_pct"], 2),
             _f(o["paired_diff_pct"], 1)] for name, o in ov.items() if isinstance(o, dict)]
    out.append(_table(["model", "state MB (params + AdamW)", "step ms", "mark() ms", "mark / step %",
                       "marked - plain step % (noise)"], rows))
    return out


def _strategy_tables(strat: dict[str, Any]) -> list[str]:
    out = [f"\n**Step time per strategy** (ms, median [p25-p75]; {strat['note']})\n"]
    models = [m for m in ("mlp", "gpt") if m in strat]
    labels = list(strat[models[0]]["step_ms"])
    rows = []
    for label in labels:
        row = [label]
        for m in models:
            s = strat[m]["spread_ms"][label]
            row.append(f"{s['median']:.2f} [{s['p25']:.2f}-{s['p75']:.2f}]")
        rows.append(row)
    for key in strat[models[0]]["ratios"]:
        rows.append([f"ratio {key}"] + [_f(strat[m]["ratios"].get(key, float("nan")), 3) for m in models])
    for key in strat[models[0]].get("paired_over_torch_ddp", {}):
        rows.append([f"paired {key} / torch_ddp"]
                    + [_f(strat[m].get("paired_over_torch_ddp", {}).get(key, float("nan")), 3) for m in models])
    header = ["variant"] + [f"{m} ({strat[m]['params'] / 1e6:.2f} M params, batch {strat[m]['per_rank_batch']})"
                            for m in models]
    out.append(_table(header, rows))
    return out + _parity_lines(strat, models) + _comm_tables(strat, models)


def _accumulation_tables(acc: dict[str, Any]) -> list[str]:
    rows = [[r["strategy"], r["k"], _f(r["allreduce_calls_per_step"], 1), f"{r['allreduce_bytes_per_step'] / 2**20:.2f}",
             f"{r['min_bytes_per_step'] / 2**20:.2f}", _f(r["bytes_over_min"], 3), r["nonfinal_calls"],
             _f(r["ms_per_sample"], 3), _f(r["time_per_sample_vs_k1"], 2)] for r in acc["rows"]]
    return [f"\n**Gradient accumulation** (MLP, {acc['world_size']} ranks, micro-batch {acc['micro_batch']}; "
            "per optimizer step)\n",
            _table(["strategy", "k", "all-reduce calls", "MB sent", "MB minimum", "sent / min",
                    "calls on non-final micro-steps", "ms / sample", "vs k=1"], rows)]


def _ray_tables(ray: dict[str, Any]) -> list[str]:
    ps, rs = ray["plain_spread_ms"], ray["ray_spread_ms"]
    return [f"\n**Ray Train overhead** ({ray['world_size']} workers, {ray['model']} + {ray['strategy']}, "
            f"batch {ray['per_rank_batch']}/rank, {ray['rounds']} round(s) x {ray['steps_per_run']} steps)\n",
            _table(["launcher", "step ms (median [p25-p75])", "start-up to first step (s)"], [
                ["plain torch.distributed", f"{ps['median']:.2f} [{ps['p25']:.2f}-{ps['p75']:.2f}]",
                 _f(ray["plain_startup_s"])],
                ["Ray Train TorchTrainer", f"{rs['median']:.2f} [{rs['p25']:.2f}-{rs['p75']:.2f}]",
                 _f(ray["ray_startup_s"])],
                ["ratio Ray / plain", _f(ray["ray_over_plain"], 3), f"ray.init: {_f(ray['ray_init_s'])} s"],
            ])]


def _checkpoint_tables(ck: dict[str, Any]) -> list[str]:
    rows = [(f"{name} (controller poll {ck['poll_s']:g} s)", st) for name, st in ck["states"].items()]
    default = ck.get("ray_default_poll")
    if default:
        rows.append((f"quickstart (Ray's default poll {default['poll_s']:g} s)", default["quickstart"]))
    return [f"\n**Checkpoint: time the step loop is blocked** ({ck['world_size']} workers, "
            f"{ck['per_mode']} checkpoint(s) per mode and state; seconds, median [min-max])\n",
            _table(["state", "MB", "training between (s)", "sync upload", "async upload", "async / sync"], [
                [label, _f(st["state_mb"], 1), _f(st["gap_s"], 2),
                 f"{st['sync']['median']:.3f} [{st['sync']['min']:.3f}-{st['sync']['max']:.3f}]",
                 f"{st['async']['median']:.3f} [{st['async']['min']:.3f}-{st['async']['max']:.3f}]",
                 _f(st["async_over_sync"], 3)] for label, st in rows])]


def _ingest_tables(ing: dict[str, Any]) -> list[str]:
    out = [f"\n**Ingest** ({ing['rows']:,} rows x {ing['features']} float32, batch {ing['batch']})\n"]
    best = ing["samples_per_s"]["in_memory"]
    rows = [[name, f"{v['samples_per_s']:,.0f}", _f(v["samples_per_s"] / best, 3), _f(v["first_batch_s"], 3)]
            for name, v in ing["readers"].items()]
    out.append(_table(["reader", "samples/s", "vs in-memory", "first batch (s)"], rows))
    if ing.get("training"):
        rows = [[s, t["workers"], t["steps"], _f(t["data_wait_fraction"], 3), f"{t['samples_per_s']:,.0f}"]
                for s, t in ing["training"].items()]
        out.append("\n" + _table(["training run: data.sharding", "workers", "steps", "data wait fraction",
                                  "samples/s"], rows))
    if ing.get("image_training"):
        rows = [[s, _f(t["data_wait_fraction"], 3), _f(t["data_wait_fraction_all"][0], 3),
                 _f(t["first_step_logged_s"], 1), f"{t['samples_per_s']:,.0f}"]
                for s, t in ing["image_training"].items() if "error" not in t]
        out.append("\n" + _table(["PNG-decode run: data.sharding", "data wait (steady)", "first interval's wait",
                                  "start -> first step logged (s)", "samples/s"], rows))
    return out


def _gpt_tables(gpt: dict[str, Any]) -> list[str]:
    rows = [[k, f"{v['tokens_per_s']:,.0f}", _f(v["step_ms"]), _f(v.get("mfu", float("nan")), 3)]
            for k, v in gpt["variants"].items()]
    return [f"\n**Tiny GPT on {gpt['device_name']}** ({gpt['precision']}, {gpt['params'] / 1e6:.1f} M params, "
            f"seq {gpt['seq_len']}, batch {gpt['batch']})\n",
            _table(["variant", "tokens/s", "step ms", "MFU"], rows)]


def _startup_tables(sec: dict[str, Any]) -> list[str]:
    """The startup section's rounds and Targets table (issue #39), when it ran (the smoke preset skips it)."""
    from benchmarks.startup import rounds_table, table_lines

    if not sec.get("figures"):
        return []
    rounds = rounds_table(sec["rounds"]) + [""] if sec.get("rounds") else []
    return ["\n**Start-up** (the quickstart; each system a command timed from its start)\n",
            "\n".join(rounds + table_lines(sec["figures"]))]


# The report's sections, in order: the results' key and its tables.
def _validation_table(sec: dict[str, Any]) -> list[str]:
    from benchmarks.step_options import validation_table

    return validation_table(sec)


def _step_option_tables(sec: dict[str, Any]) -> list[str]:
    """`compile` (rows per strategy) or `activation_checkpointing` (plain vs checkpointed)."""
    if "rows" in sec:
        return [f"\n**torch.compile** ({sec['backend']}, gpt preset, {sec['world_size']} ranks, {sec['device']}; "
                "compile s: the first step's extra time; backend s: inside the backend)\n",
                _table(["strategy", "eager ms", "compiled ms", "compiled / eager", "compile s", "backend s", "graphs",
                        "first step s: cold", "cache-loaded (new node)"],
                       [[x["strategy"], x["eager_step_ms"], x["compiled_step_ms"], x["compiled_over_eager"],
                         x["compile_s"], x["backend_compile_s"], x["graphs"], x["compiled_first_step_s"],
                         x.get("warm_first_step_s", "-")] for x in sec["rows"]])]
    return [f"\n**Activation checkpointing** (gpt preset, {sec['device']}, memory: {sec['memory_measure']})\n",
            _table(["", "step ms", sec["memory_measure"]],
                   [[k, sec[k]["step_ms"], sec[k][sec["memory_measure"]]] for k in ("plain", "checkpointed")]
                   + [["with / without", sec["step_ratio"], sec["memory_ratio"]]])]


_SECTIONS = (("strategies", _strategy_tables), ("accumulation", _accumulation_tables), ("memory", _memory_tables),
             ("ray_overhead", _ray_tables), ("checkpoint", _checkpoint_tables), ("ingest", _ingest_tables),
             ("recovery", _recovery_tables), ("startup", _startup_tables), ("gpt", _gpt_tables),
             ("compile", _step_option_tables), ("activation_checkpointing", _step_option_tables),
             ("validation", lambda sec: ["\n**Validation** (the step loop's stall per validation, local mode)\n",
                                         "\n".join(_validation_table(sec))]))


def markdown(results: dict[str, Any]) -> str:
    results = {k: v for k, v in results.items() if not (isinstance(v, dict) and "error" in v)}
    meta = results.get("meta", {})
    out = [f"### raytrain-ddp bench ({meta.get('preset')}, device {meta.get('device')}, "
           f"{meta.get('cpu_count')} cores, torch {meta.get('torch')}, ray {meta.get('ray')}, "
           f"{_f(meta.get('duration_s', float('nan')), 0)} s)"]
    for key, tables in _SECTIONS:
        if results.get(key):
            out += tables(results[key])
    ver = verdicts(results)
    if ver:
        out.append("\n**Targets**\n")
        out.append(_table(["target", "measured", "limit", "met"],
                          [[v["target"], _f(float(v["value"]), 3), v["limit"], "yes" if v["met"] else "NO"] for v in ver]))
    return "\n".join(out) + "\n"


def _panel_strategies(ax: Any, sec: dict[str, Any]) -> None:
    models = [m for m in ("mlp", "gpt") if m in sec]
    labels = list(sec[models[0]]["step_ms"])
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        single = sec[m]["step_ms"]["single"]
        vals = [sec[m]["step_ms"][lab] / single for lab in labels]
        ax.bar([j + i * width for j in range(len(labels))], vals, width, label=m)
    ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("step time / single process")
    ax.set_title("strategies")
    ax.legend(fontsize=8)


def _panel_accumulation(ax: Any, sec: dict[str, Any]) -> None:
    for strategy in sec["strategies"]:
        rows = [r for r in sec["rows"] if r["strategy"] == strategy]
        ax.plot([r["k"] for r in rows], [r["ms_per_sample"] for r in rows], marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("accumulation steps k")
    ax.set_ylabel("ms per sample")
    ax.set_title("accumulation (bytes/min = 1.00)")
    ax.legend(fontsize=8)


def _panel_ray_overhead(ax: Any, sec: dict[str, Any]) -> None:
    ax.bar(["plain", "Ray Train"], [sec["plain_step_ms"], sec["ray_step_ms"]], color=["C0", "C1"])
    ax.set_ylabel("steady-state step ms")
    ax.set_title(f"Ray overhead: x{sec['ray_over_plain']:.3f}")


def _panel_checkpoint(ax: Any, sec: dict[str, Any]) -> None:
    names = list(sec["states"])
    for i, mode in enumerate(("sync", "async")):
        ax.bar([j + 0.4 * i for j in range(len(names))], [sec["states"][n][mode]["median"] for n in names],
               0.4, label=mode)
    ax.set_xticks([j + 0.2 for j in range(len(names))])
    ax.set_xticklabels([f"{n} ({sec['states'][n]['state_mb']:.0f} MB)" for n in names], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("s blocked per checkpoint")
    ax.set_title("checkpoint upload")
    ax.legend(fontsize=8)


def _panel_ingest(ax: Any, sec: dict[str, Any]) -> None:
    names = list(sec["samples_per_s"])
    ax.bar(names, [sec["samples_per_s"][n] for n in names], color="C2")
    ax.set_yscale("log")
    ax.set_ylabel("samples/s")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.set_title(f"ingest; wait in training {100 * sec.get('data_wait_fraction', float('nan')):.1f}%")


def _panel_gpt(ax: Any, sec: dict[str, Any]) -> None:
    names = list(sec["variants"])
    ax.bar(names, [sec["variants"][n]["tokens_per_s"] for n in names], color="C3")
    ax.set_ylabel("tokens/s")
    ax.set_title("tiny GPT")


# The figure's panels, left to right: the results' key and how it is drawn.
_PANELS = {"strategies": _panel_strategies, "accumulation": _panel_accumulation, "ray_overhead": _panel_ray_overhead,
           "checkpoint": _panel_checkpoint, "ingest": _panel_ingest, "gpt": _panel_gpt}


def plot(results: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in _PANELS if results.get(k) and "error" not in results[k]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    for ax, key in zip(axes[0], panels):
        _PANELS[key](ax, results[key])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish_section_run(results: dict[str, Any], out: Optional[str]) -> int:
    """A section run alone (`python -m benchmarks.<section>`): verdicts, the JSON
    (when `out` is given) and the tables on stdout, as `raytrain-ddp bench` ends."""
    results["targets"] = verdicts(results)
    if out:
        Path(out).write_text(json.dumps(results, indent=2, default=float) + "\n")
    print(markdown(results))
    return 0
