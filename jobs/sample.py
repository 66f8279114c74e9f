"""Continue a prompt with a model that jobs/pretrain.py trained: read what a checkpoint writes.

    python jobs/sample.py outputs/ray_results/tiny                       # the run's latest checkpoint
    python jobs/sample.py outputs/ray_results/tiny/checkpoint_step_00000250 --prompt "The module" --samples 3
    mlflow artifacts download -u models:/nsa-tiny/1 -d /tmp/nsa-tiny && python jobs/sample.py /tmp/nsa-tiny

SOURCE is a checkpoint directory, a run directory (its latest checkpoint) or a final model as the run logs it to
MLflow (model.pt + config.yaml). The model is rebuilt from the config.yaml saved beside its weights; the tokenizer
is --tokenizer, else the one that config names (data.tokenizer, as training loaded it). Each sample starts a new
document (the EOS token, then the prompt) and stops at the next EOS or after --max-new-tokens. Every token reruns
the model over the whole context (nsa_model/generate.py): fine for reading samples, slow for long ones.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from any directory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="checkpoint, run or model directory")
    parser.add_argument("--prompt", default="", help="text to continue (default: none, a document from its start)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token")
    parser.add_argument("--top-k", type=int, default=50, help="draw from the k most likely tokens; 0: from all")
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda[:N]")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json to use instead of the run's")
    return parser.parse_args(argv)


def load_model(source: Path, device):
    """(job config, Transformer in eval mode on device) from a checkpoint, run or model directory."""
    import torch

    from nsa_model.model import Transformer
    from pipeline.config import load_job_config
    from pipeline.train import checkpoint as ckpt

    directory = ckpt.trained_model_dir(source)
    job = load_job_config(directory / ckpt.CONFIG_FILE)
    model = Transformer(job.model)
    model.load_state_dict(ckpt.load_trained_weights(directory), strict=True)
    print(f"model: {directory} ({model.num_params() / 1e6:.2f}M parameters, attention {job.model.attention})",
          flush=True)
    return job, model.to(device=torch.device(device)).eval()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from nsa_model.generate import check_sampling
    try:
        check_sampling(args.max_new_tokens, args.temperature, args.top_k or None)
        if args.samples < 1:
            raise ValueError(f"--samples: must be >= 1, got {args.samples}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import torch

    from nsa_model.generate import generate
    from pipeline.data.tokenizer import load_tokenizer, load_tokenizer_file

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        job, model = load_model(Path(args.source), device)
        tokenizer = (load_tokenizer_file(Path(args.tokenizer), job.data.eos_token) if args.tokenizer
                     else load_tokenizer(job.data))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if tokenizer.vocab_size > job.model.vocab_size:
        print(f"error: tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens, more than the model's "
              f"{job.model.vocab_size}: not the tokenizer it was trained with", file=sys.stderr)
        return 2
    print(f"tokenizer: {tokenizer.name} (sha256 {tokenizer.sha256[:12]})", flush=True)

    prompt = [tokenizer.eos_id] + tokenizer.encode_batch([args.prompt])[0]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    # bf16 on GPUs, where the Triton kernels run; fp32 on CPUs
    on_gpu = device.startswith("cuda")
    for i in range(args.samples):
        with torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext():
            ids = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k or None, stop_id=tokenizer.eos_id, vocab_size=tokenizer.vocab_size,
                           generator=generator)
        ended = "[end of document]" if ids and ids[-1] == tokenizer.eos_id else f"[{len(ids)} tokens]"
        text = tokenizer.decode(ids[:-1] if ids and ids[-1] == tokenizer.eos_id else ids)
        print(f"--- sample {i + 1} of {args.samples} ---\n{args.prompt}{text} {ended}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
