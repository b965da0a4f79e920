"""Command line: `python -m strata_jax generate ...` (serve, quantize and plan arrive with their issues)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "ckpt" / "qwen4_exp_causal"


def _generate(args: argparse.Namespace) -> int:
    from strata_jax import load_model

    model = load_model(args.model, dtype=args.dtype)
    tok = model.tokenizer
    if tok is None:
        print(f"error: {args.model} has no tokenizer.json", file=sys.stderr)
        return 2
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True)
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        print("error: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    started = time.monotonic()
    out = model.generate(ids, args.max_tokens, temperature=args.temperature, seed=args.seed)
    elapsed = time.monotonic() - started
    print(tok.decode(out))
    print(
        f"[{len(ids)} prompt tokens, {len(out)} generated in {elapsed:.2f}s "
        f"({len(out) / max(elapsed, 1e-9):.1f} tok/s incl. compile)]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m strata_jax",
        description="strata_jax: serve huge Mixture-of-Experts coding models from one GPU.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="continue a prompt with a checkpoint",
        description="Load a Hugging Face checkpoint directory and continue a prompt.",
    )
    gen.add_argument("--model", default=str(DEMO_MODEL), help="checkpoint directory (default: the bundled fixture)")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "max_tokens", 1) < 1:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
