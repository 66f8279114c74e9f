"""Where a GPU trial's first steps go: the NSA kernels' Triton compilation, torch.compile and CUDA graphs, with the
compile caches cold and warm (kernels-notes.md v73, v74).

    python bench/probe_trial_start.py --commit SHA [--out bench/results --suffix -vNN --compile-scope model \
        --preset nsa-125m --seq-len 8192 --micro-batch 4 --accum 2 --sel-block 64 --n-selected 16 \
        --other-n-selected 8 --other-sel-block 128 --runs cold-compiled,warm-compiled,other-setting,...]

A Tune trial on a GPU (configs/sweep-125m-gpu.yaml) spent about 130 s before its steps reached their pace against
15-60 s of steps (stop 75). This probe takes the model alone (no Ray, no data pipeline: pipeline/train/loop.py's
Startup measures those) through the steps a trial's first steps hold, each measurement in a fresh Python process
over cache folders the probe owns (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR; a set TRITON_CACHE_DIR is what
compile_model's pin gives a trial since v75: before, inductor moved the folder partway, and a sweep's trials missed
the NSA kernels the probe found in the cache), in this order:

  cold-eager     empty caches; eager steps (the NSA kernels compile in the first), then compiled steps
  cold-compiled  empty caches, compiled steps only: a sweep's first trial on a node
  warm-compiled  the same setting, compiled steps only, over what the first cold run cached: a trial repeated
  other-setting  another n (--other-n-selected), over those caches: a sweep's next trial on the node
  other-block    another l' (--other-sel-block), over those caches
  new-node       empty caches, but first the torch.compile artifacts and Triton cache entries the form's cold run
                 saved to a shared folder (pipeline/train/compile_cache.py, as train.compile_cache does; loaded before
                 the precompile, as the loop does): a run on a node that never compiled
  new-node-other the same with another n: a sweep's next trial lands on a new node

Each run compiles as the training loop does, by nsa_model.compile_model (l' and n symbolic in the traced graph),
or, with the suffix -static (cold-compiled-static, other-setting-static, ...), by plain torch.compile, which
bakes them into the graph as constants: the baseline, with cache folders of its own. A run named cold takes the
folders of its form if no run has used them yet, else fresh ones; the others take its form's folders and need a
cold run of that form before them. Each cold run saves what torch.compile used to its form's shared folder; the
new-node runs take fresh folders of their own and load that before their steps.

A step is one optimizer step as the loop runs it (bf16 autocast, fused AdamW, --accum micro-batches of
--micro-batch x --seq-len random tokens). Each child reports its phases' seconds (synchronized), every Triton
compilation it ran in its own process (kernel, seconds, cache hit; through triton.knobs.compilation.listener),
inductor's FX graph cache and AOT autograd's cache hits and misses, and dynamo's compile-time table. Writes
<out>/trial-start-<device>-<date><suffix>.{json,md} (bench/provenance.py) and prints the table.

--compile-scope blocks compiles each transformer block on its own (torch's regional compilation) instead of the
whole model: one block's code serves all of them, so the first compiled step is shorter, but the embedding, the
head and the loss run eagerly between CUDA graphs (kernels-notes.md v73 measured both).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.provenance import file_suffix, git_commit, result_file, result_stem  # noqa: E402


def child(args) -> dict:
    t0 = time.time()
    import torch
    import triton

    from nsa_model import Transformer, compile_model, get_preset
    from pipeline.train.loop import FlatGradients

    record = {"import_s": time.time() - t0, "compiles": []}

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        record["compiles"].append({"kernel": getattr(src, "name", str(src))[:80], "s": times.total / 1e6,
                                   "cache_hit": bool(cache_hit)})

    triton.knobs.compilation.listener = listener
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t = time.time()
    torch.zeros(1, device=device)
    record["cuda_init_s"] = time.time() - t
    cfg = get_preset(args.preset)
    cfg = cfg.replace(max_seq_len=args.seq_len, nsa=dataclasses.replace(cfg.nsa, sel_block=args.sel_block,
                                                                         n_selected=args.n_selected))
    t = time.time()
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    sync()
    record["model_s"] = time.time() - t
    shared = None
    if args.share:
        from pipeline.train.compile_cache import SharedCompileCache

        shared = SharedCompileCache(args.share_folder, {"probe": [args.preset, args.seq_len, args.micro_batch,
                                                                  args.compile_mode, args.compile_scope, args.form]})
        if args.share == "load":  # before the precompile, as the loop: it finds the NSA kernels' entries
            shared.load()
            record.update(shared_loaded=len(shared.loaded), shared_triton_loaded=len(shared.triton_loaded),
                          shared_load_s=shared.load_s)
        else:  # notes the Triton cache entries this run uses, for the save
            shared.start_recording()
    if args.precompile:  # as the training loop does on GPUs (train.precompile_kernels)
        from nsa_model.precompile import compile_nsa_kernels

        t = time.time()
        record["precompiled_kernels"] = compile_nsa_kernels(model, args.micro_batch, args.seq_len, torch.bfloat16)
        sync()
        record["precompile_s"] = time.time() - t
    if shared is not None:  # as the loop: the Triton cache entries shared are the precompile's
        shared.stop_recording()
    record["compiles_before_steps"] = len(record["compiles"])  # the steps should add none of the NSA kernels
    # As the loop: under CUDA graphs one flat gradient buffer autograd adds into (a replayed backward's outputs
    # would otherwise be overwritten by the next micro-batch's replay before accumulation read them).
    grads = FlatGradients(optimizer) if args.compile_mode == "reduce-overhead" else None
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq_len + 1), device=device)

    def step(forward, graphs: bool) -> float:
        sync()
        start = time.time()
        for _ in range(args.accum):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                _, loss = forward(tokens[:, :-1], tokens[:, 1:])
            if grads is not None:
                grads.backward(loss / args.accum)
            else:
                (loss / args.accum).backward()
        optimizer.step()
        if grads is not None:
            grads.zero_()
        else:
            optimizer.zero_grad(set_to_none=False)
        sync()
        return time.time() - start

    if args.phases in ("eager+compiled",):
        record["eager_steps_s"] = [step(model, False) for _ in range(3)]
    if args.compile_scope == "blocks":  # regional: each transformer block compiled, one compiled code for all
        for block in model.blocks:
            block.compile(mode=args.compile_mode)
        forward = model
    else:
        forward = (compile_model if args.form == "symbolic" else torch.compile)(model, mode=args.compile_mode)
    graphs = args.compile_mode == "reduce-overhead"
    record["compiled_steps_s"] = [step(forward, graphs) for _ in range(6)]
    if args.share == "save":
        shared.save()
        record.update(shared_saved=shared.saved, shared_triton_saved=shared.triton_saved)
    if shared is not None:
        record["shared_problems"] = shared.problems
    from torch._dynamo.utils import compile_times, counters

    record["dynamo_compile_times"] = compile_times(repr="str")
    record["graph_caches"] = {key: counters[group][key] for group, keys in CACHE_COUNTERS.items() for key in keys}
    record["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    return record


CACHE_COUNTERS = {"inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss"),
                  "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss")}

# name: (phases, setting, caches); a name ending in -static runs the same with plain torch.compile
RUNS = {"cold-eager": ("eager+compiled", "base", "cold"), "cold-compiled": ("compiled", "base", "cold"),
        "warm-compiled": ("compiled", "base", "warm"), "other-setting": ("compiled", "other-n", "warm"),
        "other-block": ("compiled", "other-block", "warm"), "new-node": ("compiled", "base", "new"),
        "new-node-other": ("compiled", "other-n", "new")}
DEFAULT_RUNS = "cold-compiled,warm-compiled,other-setting,other-block,cold-compiled-static,other-setting-static"


def parse_runs(text: str) -> list[tuple[str, str, str, str, str]]:
    """[(name, phases, setting, cache folder, form)] in the order given: a form's first cold run and its warm runs
    share the folder named by the form, a later cold run and each new-node run have one of their own. Refuses
    unknown names, repeats, and a warm or new-node run with no cold run of its form before it."""
    runs, cold_forms = [], set()
    for name in text.split(","):
        base, form = (name[:-len("-static")], "static") if name.endswith("-static") else (name, "symbolic")
        if base not in RUNS or name in [r[0] for r in runs]:
            raise argparse.ArgumentTypeError(f"--runs: {name!r} is unknown or repeated; runs are {sorted(RUNS)}, "
                                             "each also with the suffix -static")
        phases, setting, caches = RUNS[base]
        if caches in ("warm", "new") and form not in cold_forms:
            raise argparse.ArgumentTypeError(f"--runs: {name} reads the caches a cold run of its form left; put "
                                             f"cold-compiled{'-static' if form == 'static' else ''} before it")
        folder = name if caches == "new" or (caches == "cold" and form in cold_forms) else form
        cold_forms |= {form} if caches == "cold" else set()
        runs.append((name, phases, setting, folder, form))
    return runs


def run_child(name: str, phases: str, sel_block: int, n_selected: int, form: str, caches: Path, args) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"))
    kind = RUNS[name.removesuffix("-static")][2]
    share = {"cold": ["--share", "save"], "new": ["--share", "load"]}.get(kind, [])
    share += ["--share-folder", str(caches.parent / "shared" / form)] if share else []
    cmd = [sys.executable, __file__, "--child", "--phases", phases, "--n-selected", str(n_selected),
           "--preset", args.preset, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
           "--accum", str(args.accum), "--sel-block", str(sel_block), "--compile-mode", args.compile_mode,
           "--device", args.device, "--compile-scope", args.compile_scope, "--form", form,
           *(["--precompile"] if args.precompile else []), *share]
    start = time.time()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if out.returncode != 0:
        raise RuntimeError(f"{name}: child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    record = json.loads(out.stdout.strip().splitlines()[-1])
    record.update(name=name, phases=phases, sel_block=sel_block, n_selected=n_selected, form=form,
                  process_wall_s=wall)
    return record


def summary_line(r: dict) -> str:
    compiled = r["compiled_steps_s"]
    steady = min(compiled[3:])
    nsa = [c for c in r["compiles"] if not c["cache_hit"]]
    eager = r.get("eager_steps_s")
    caches = r["graph_caches"]
    cells = [r["name"], f"{r['sel_block']} / {r['n_selected']}", f"{r['process_wall_s']:.1f}", f"{r['import_s']:.1f}",
             f"{r['cuda_init_s']:.1f}", f"{r['model_s']:.1f}",
             f"{r['precompile_s']:.1f} ({r['precompiled_kernels']})" if "precompile_s" in r else "-",
             f"{eager[0]:.1f} / {eager[-1]:.2f}" if eager else "-",
             " / ".join(f"{s:.1f}" for s in compiled[:3]), f"{steady:.3f}",
             f"{len(nsa)} in {sum(c['s'] for c in nsa):.1f} s",
             f"{sum(1 for c in r['compiles'] if c['cache_hit'])}",
             f"{caches['fxgraph_cache_hit']} / {caches['fxgraph_cache_miss']}",
             f"{caches['autograd_cache_hit']} / {caches['autograd_cache_miss']}",
             (f"loaded {r['shared_loaded']} + {r.get('shared_triton_loaded', 0)} in {r['shared_load_s']:.1f} s"
              if "shared_loaded" in r else
              f"saved {r['shared_saved']} + {r.get('shared_triton_saved', 0)}" if "shared_saved" in r else "-")
             + "".join(f"; {problem}" for problem in r.get("shared_problems", []))]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--commit", default="", help="the commit measured (a GPU host's copy of the tree has no git)")
    p.add_argument("--suffix", type=file_suffix, default="")
    p.add_argument("--child", action="store_true")
    p.add_argument("--phases", default="eager+compiled", choices=("eager+compiled", "compiled"))
    p.add_argument("--preset", default="nsa-125m")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--sel-block", type=int, default=64)
    p.add_argument("--n-selected", type=int, default=16)
    p.add_argument("--other-n-selected", type=int, default=8)
    p.add_argument("--other-sel-block", type=int, default=128)
    p.add_argument("--compile-scope", default="model", choices=("model", "blocks"))
    p.add_argument("--form", default="symbolic", choices=("symbolic", "static"), help="(a child's)")
    p.add_argument("--share", choices=("save", "load"), help="(a child's) the shared compile cache, after its "
                   "steps or before its precompile")
    p.add_argument("--share-folder", help="(a child's)")
    p.add_argument("--runs", type=parse_runs, default=parse_runs(DEFAULT_RUNS))
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of the probe itself (--preset tiny "
                   "--seq-len 256 --compile-mode default; at T = 64 and 128 torch 2.13's CPU inductor crashed in the "
                   "compiled backward, kernels-notes.md v73)")
    p.add_argument("--compile-mode", default="reduce-overhead", choices=("default", "reduce-overhead"))
    p.add_argument("--precompile", action="store_true", help="each run compiles the NSA kernels before its steps, "
                   "side by side (nsa_model/precompile.py), as the training loop does on GPUs")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    runs = []
    settings = {"base": (args.sel_block, args.n_selected), "other-n": (args.sel_block, args.other_n_selected),
                "other-block": (args.other_sel_block, args.n_selected)}
    with tempfile.TemporaryDirectory(prefix="trial-start-") as tmp:
        for name, phases, setting, folder, form in args.runs:
            runs.append(run_child(name, phases, *settings[setting], form, Path(tmp) / folder, args))
            print(summary_line(runs[-1]), flush=True)
    stem, meta = result_stem(args.out, "trial-start", args.suffix, args.commit or git_commit())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    recorded_args = dict(vars(args), runs=",".join(r[0] for r in args.runs))
    result_file(stem, ".json").write_text(json.dumps({"meta": meta, "args": recorded_args, "runs": runs}, indent=1))
    text = markdown(meta, args, runs)
    print(text)
    result_file(stem, ".md").write_text(text)


def markdown(meta: dict, args, runs: list[dict]) -> str:
    lines = [f"# Where a trial's first steps go: {meta['device']}, {meta['date']}", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}; bench/probe_trial_start.py "
             f"--compile-scope {args.compile_scope}: {args.preset} at T = {args.seq_len}, {args.accum} micro-batches "
             f"of {args.micro_batch} a step, torch.compile mode {args.compile_mode}; runs compiled by "
             "nsa_model.compile_model (l' and n symbolic), those named -static by plain torch.compile; NSA kernels "
             f"{'compiled before the steps, side by side' if args.precompile else 'compiled at their first launch'}"
             ". Seconds; each run a fresh process.",
             "", "| run | l' / n | process s | import | CUDA init | model | kernels before the steps (count) | eager "
             "step 1 / steady | compiled steps 1 / 2 / 3 | steady (fastest of steps 4-6) | Triton compiles (this "
             "process) | Triton cache hits | FX graph cache hits / misses | AOT autograd cache hits / misses | shared "
             "compile cache (artifacts + Triton cache entries) |",
             "|---" * 15 + "|"]
    lines += [summary_line(r) for r in runs]
    for r in runs:
        lines += ["", f"## {r['name']}: slowest Triton compilations in the process", "", "```"]
        lines += [f"{c['s']:6.2f} s  {'hit ' if c['cache_hit'] else 'miss'}  {c['kernel']}"
                  for c in sorted(r["compiles"], key=lambda c: -c["s"])[:12]]
        lines += [r["dynamo_compile_times"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
