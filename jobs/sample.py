"""Continue a prompt with a model that jobs/pretrain.py trained: read what a checkpoint writes.

    python jobs/sample.py outputs/ray_results/tiny                       # the run's latest checkpoint
    python jobs/sample.py outputs/ray_results/tiny/checkpoint_step_00000250 --prompt "The module" --samples 3
    mlflow artifacts download -u models:/nsa-tiny/1 -d /tmp/nsa-tiny && python jobs/sample.py /tmp/nsa-tiny

SOURCE is a checkpoint directory, a run directory (its latest checkpoint) or a final model as the run logs it to
MLflow (model.pt + config.yaml). The model is rebuilt from the config.yaml saved beside its weights; the tokenizer
is --tokenizer, else the one that config names (data.tokenizer, as training loaded it). Each sample starts a new
document (the EOS token, then the prompt) and stops at the next EOS or after --max-new-tokens. The samples are
drawn together, as the rows of one batch: the prompt runs through the model once, and each new token of every
sample is then one decoding step over the layers' caches (nsa_model/generate.py; --no-cache reruns the whole
context for every token instead, the slow reference).
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
    parser.add_argument("--samples", type=int, default=1,
                        help="continuations drawn together, as one batch (the cache holds the context once a sample)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (cuda when present), cpu or cuda[:N]")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json to use instead of the run's")
    parser.add_argument("--no-cache", action="store_true",
                        help="run the whole context for every token instead of a decoding step (slow; a check)")
    return parser.parse_args(argv)


def resolve_device(text: str) -> str:
    """auto: cuda when present, else cpu; cuda[:N] refused where that GPU is absent."""
    import torch

    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return text
    kind, _, index = text.partition(":")
    if kind != "cuda" or not (index == "" or index.isdigit()):
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {text!r}")
    if int(index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def load_model(source: Path, device: str):
    """(job config, Transformer in eval mode on device) from a checkpoint, run or model directory."""
    import pickle

    import torch

    from nsa_model.model import Transformer
    from pipeline.config import load_job_config
    from pipeline.train import checkpoint as ckpt

    directory = ckpt.trained_model_dir(source)
    job = load_job_config(directory / ckpt.CONFIG_FILE)
    model = Transformer(job.model)
    try:
        model.load_state_dict(ckpt.load_trained_weights(directory), strict=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as e:  # a torn file, or weights of another model
        raise ValueError(f"{directory}: its weights do not load into the model its config.yaml describes: {e}")
    print(f"model: {directory} ({model.num_params() / 1e6:.2f}M parameters, attention {job.model.attention})",
          flush=True)
    return job, model.to(device=torch.device(device)).eval()


def load_run_tokenizer(job, tokenizer_file: str | None):
    """--tokenizer, else the tokenizer the run's config names. Never trains one: the embedded BPE must already be
    where training left it (a tokenizer trained here on another corpus would give other ids for the same text)."""
    from pipeline.data.config import EMBEDDED
    from pipeline.data.tokenizer import embedded_tokenizer_path, load_tokenizer, load_tokenizer_file

    if tokenizer_file is not None:
        tokenizer = load_tokenizer_file(Path(tokenizer_file), job.data.eos_token)
    elif job.data.tokenizer == EMBEDDED:
        path = embedded_tokenizer_path(job.data)
        if not path.exists():
            raise FileNotFoundError(f"the run's tokenizer is not at {path}, where its training built it: pass its "
                                    f"copy with --tokenizer (the run's MLflow artifact tokenizer/tokenizer.json)")
        tokenizer = load_tokenizer_file(path, job.data.eos_token)
    else:
        tokenizer = load_tokenizer(job.data)
    if tokenizer.vocab_size > job.model.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens, more than the model's "
                         f"{job.model.vocab_size}: not the tokenizer it was trained with")
    # the run's MLflow params hold the sha256 of the tokenizer it trained with (tokenizer.sha256)
    print(f"tokenizer: {tokenizer.name} (sha256 {tokenizer.sha256[:12]})", flush=True)
    return tokenizer


def print_samples(args, model, tokenizer, device: str) -> None:
    import torch

    from nsa_model.generate import generate_samples

    prompt = [tokenizer.eos_id] + tokenizer.encode_batch([args.prompt])[0]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    # bf16 on GPUs, where the Triton kernels run; fp32 on CPUs
    with torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext():
        samples = generate_samples(model, prompt, args.max_new_tokens, args.samples, temperature=args.temperature,
                                   top_k=args.top_k or None, stop_id=tokenizer.eos_id,
                                   vocab_size=tokenizer.vocab_size, generator=generator, use_cache=not args.no_cache)
    for i, ids in enumerate(samples):
        ended = ids[-1:] == [tokenizer.eos_id]
        text = tokenizer.decode(ids[:-1] if ended else ids)
        print(f"--- sample {i + 1} of {args.samples} ---\n{args.prompt}{text} "
              f"{'[end of document]' if ended else f'[{len(ids)} tokens]'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from nsa_model.generate import check_sampling
    try:
        check_sampling(args.max_new_tokens, args.temperature, args.top_k or None)
        if args.samples < 1:
            raise ValueError(f"--samples: must be >= 1, got {args.samples}")
        device = resolve_device(args.device)
        job, model = load_model(Path(args.source), device)
        tokenizer = load_run_tokenizer(job, args.tokenizer)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_samples(args, model, tokenizer, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
