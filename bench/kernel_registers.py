"""Registers and spills of every Triton kernel compiled for sm_90 (Hopper), on a machine without a GPU.

    python bench/kernel_registers.py [--match NAME ...] [--no-hints] [--out bench/results]

Compiles each kernel case of tests/test_triton_compile.py (nsa-125m's constexprs, the launchers' default options,
both sides of each TMA switch) to PTX with Triton's front end, then runs the ptxas bundled with Triton with -v and
reads its "Used N registers" and spill lines. No device time: the compile needs no GPU.

The runtime specializes a pointer argument, and an integer argument whose value is a multiple of 16, as divisible
by 16, and that changes the code: without those hints the compiler cannot vectorize or pipeline some loads, and
the same kernel reports up to 1.6 KB of spill stores that the GPU never runs (kernels-notes.md v37). So by default
every pointer and the integer arguments named in DIVISIBLE_INTS (sizes and row pitches that are multiples of 16
at nsa-125m's shapes) get the hint; --no-hints compiles without them.

Writes <out>/kernel-registers-sm90-<date><suffix>.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.provenance import file_suffix, git_commit  # noqa: E402

# Integer arguments that are multiples of 16 at nsa-125m's training shapes (T = 2048..32768, 12 x 64 query
# columns, 2 x 64 key columns), as the runtime would specialize them.
DIVISIBLE_INTS = ("T", "K_ROW", "V_ROW", "num_keys", "num_queries", "num_rows", "window", "num_blocks")

# One kernel case compiled for sm_90 in a fresh interpreter: argv[1] is the JSON of (module, name, pointer dtypes,
# scalar types, constexprs, launch options, integer arguments divisible by 16, hints on or off), argv[2] where to
# write the PTX (or ""). Prints the cubin's size. tests/test_triton_compile.py runs it too (hints off).
COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module, name, pointers, scalars, constexprs, options, divisible_ints, hints = json.loads(sys.argv[1])
fn = getattr(importlib.import_module(module), name)
signature = {}
for arg in fn.arg_names:
    if arg in constexprs:
        signature[arg] = "constexpr"
    elif arg in scalars:  # a list: a tuple argument of such scalars
        kind = scalars[arg]
        signature[arg] = tuple(kind) if isinstance(kind, list) else kind
    else:  # a list: a tuple of pointers; a tensor descriptor by its type
        kind = pointers.get(arg, "bf16")
        if isinstance(kind, list):
            signature[arg] = tuple("*" + k for k in kind)
        else:
            signature[arg] = kind if kind.startswith("tensordesc") else "*" + kind
constexprs = {k: tuple(v) if isinstance(v, list) else v for k, v in constexprs.items()}  # JSON gave lists
attrs = {}
if hints:
    for i, arg in enumerate(fn.arg_names):
        kind = signature[arg]
        if kind != "constexpr" and (isinstance(kind, str) and kind.startswith("*") or arg in divisible_ints):
            attrs[(i,)] = [["tt.divisibility", 16]]
kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                        options=options)
if sys.argv[2]:
    with open(sys.argv[2], "w") as f:
        f.write(kernel.asm["ptx"])
print(len(kernel.asm["cubin"]))
"""


def parse_ptxas(log: str) -> dict:
    """{registers, spill_stores, spill_loads} (bytes) from `ptxas -v` output of one kernel."""
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if len(regs) != 1 or len(spills) != 1:
        raise ValueError(f"ptxas -v: expected one kernel's register and spill lines, got {log[-500:]!r}")
    return {"registers": int(regs[0]), "spill_stores": int(spills[0][0]), "spill_loads": int(spills[0][1])}


def compile_case(module, name, pointers, scalars, constexprs, options, hints=True) -> dict:
    """Registers and spills of one kernel case compiled for sm_90, in a subprocess (the interpreter must be off)."""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        env["TRITON_CACHE_DIR"] = tmp  # compile for real
        ptx = os.path.join(tmp, "kernel.ptx")
        spec = json.dumps([module, name, pointers, scalars, constexprs, options, DIVISIBLE_INTS, hints])
        run = subprocess.run([sys.executable, "-c", COMPILE, spec, ptx], capture_output=True, text=True, env=env,
                             timeout=300)
        if run.returncode:
            raise RuntimeError(f"{name}: the sm_90 compile failed: {run.stderr[-2000:]}")
        v = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(tmp, "kernel.o")],
                           capture_output=True, text=True, timeout=300)
        if v.returncode:
            raise RuntimeError(f"{name}: ptxas failed: {v.stderr[-2000:]}")
    return parse_ptxas(v.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--match", nargs="*", default=[], help="only cases whose id contains one of these")
    ap.add_argument("--no-hints", action="store_true", help="compile without the runtime's divisibility hints")
    ap.add_argument("--suffix", type=file_suffix, default="")
    ap.add_argument("--commit", default="")
    args = ap.parse_args()
    from tests.test_triton_compile import CASES
    import triton

    rows = []
    for case in CASES:
        if args.match and not any(m in case.id for m in args.match):
            continue
        module, name, pointers, scalars, constexprs, options = case.values
        row = {"case": case.id, "options": options, **compile_case(module, name, pointers, scalars, constexprs,
                                                                    options, hints=not args.no_hints)}
        rows.append(row)
        print(f"{case.id:78s} {row['registers']:4d} registers, spills {row['spill_stores']} / "
              f"{row['spill_loads']} bytes", flush=True)
    if not rows:
        raise SystemExit(f"--match {args.match}: no case of tests/test_triton_compile.py matches")
    date = datetime.datetime.now(datetime.timezone.utc)
    meta = {"date": date.strftime("%Y-%m-%d %H:%M UTC"), "commit": args.commit or git_commit(),
            "triton": triton.__version__, "target": "sm_90a", "hints": not args.no_hints}
    stem = os.path.join(args.out, f"kernel-registers-sm90-{date:%Y-%m-%d}{args.suffix}")
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# Registers and spills, Triton kernels compiled for sm_90 offline ({meta['date']})", "",
             f"commit {meta['commit']}, triton {meta['triton']}, ptxas -v for {meta['target']}, divisibility "
             f"hints {'on (as the runtime gives them)' if meta['hints'] else 'off'}; nsa-125m constexprs "
             "(tests/test_triton_compile.py)", "",
             "| kernel case | warps, stages | registers | spill stores / loads (bytes) |", "|---|---|---|---|"]
    for r in rows:
        o = r["options"]
        lines.append(f"| `{r['case']}` | {o.get('num_warps')}, {o.get('num_stages')}"
                     f"{', maxnreg ' + str(o['maxnreg']) if 'maxnreg' in o else ''} | {r['registers']} | "
                     f"{r['spill_stores']} / {r['spill_loads']} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", stem + ".md")


if __name__ == "__main__":
    main()
