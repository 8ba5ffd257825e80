"""Write a random-initialised GPT-2 checkpoint in Hugging Face format (no transformers needed;
the library is engine/worker/models/random_checkpoint.py).

    python scripts/make_checkpoint.py --arch gpt2-medium --out /tmp/gpt2-medium
    python scripts/make_checkpoint.py --n-layer 2 --n-embd 64 --n-head 4 --out /tmp/tiny
"""
from __future__ import annotations

import argparse

from engine.worker.models.random_checkpoint import ARCHS, DTYPES, make_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHS), help="named size (default gpt2)")
    parser.add_argument("--n-layer", type=int, help="overrides the arch's layer count")
    parser.add_argument("--n-embd", type=int, help="overrides the arch's hidden size")
    parser.add_argument("--n-head", type=int, help="overrides the arch's head count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--out", required=True, help="directory to write")
    args = parser.parse_args()
    try:
        out = make_checkpoint(args.out, args.arch, args.n_layer, args.n_embd, args.n_head,
                              args.seed, args.dtype)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
