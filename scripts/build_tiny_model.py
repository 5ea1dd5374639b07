"""Build a tiny random-weight Llama with a locally trained tokenizer, offline and deterministically.

    .venv-vllm/bin/python scripts/build_tiny_model.py OUT_DIR

Run by scripts/real_vllm.sh (``make real-vllm``) with ``HF_HUB_OFFLINE=1``: nothing is fetched.

- Tokenizer: a byte-level BPE (vocabulary 2,048) trained with ``tokenizers`` on generated
  English-like text, wrapped in ``PreTrainedTokenizerFast`` with a ChatML chat template (the
  same rendering as ``policies/prompt.py``) and ``<|im_end|>`` as end of sequence.
- Model: ``LlamaForCausalLM`` with hidden size 128, 2 layers, 4 heads, bfloat16 (what vLLM
  on CPU serves it in), weights drawn with ``torch.manual_seed(SEED)``; 512 positions (the
  tests serve it with ``--max-model-len 512``).

The same script with the same library versions writes the same bytes; ``fingerprint.txt`` holds
a SHA-256 of every file, so two builds can be compared.
"""

from __future__ import annotations

import hashlib
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 20240611
VOCAB_SIZE = 2048
CORPUS_LINES = 4000
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "nd", "st"]


def corpus(rng: random.Random) -> list[str]:
    """Generated sentences: a Zipf-like vocabulary of made-up words, digits and punctuation."""
    words = sorted(
        {
            "".join(
                rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                for _ in range(rng.randint(1, 3))
            )
            for _ in range(3000)
        }
    )
    common = ["the", "a", "of", "and", "to", "in", "is", "node", "cache", "token", "request"]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    lines = []
    for _ in range(CORPUS_LINES):
        parts: list[str] = []
        for _ in range(rng.randint(6, 24)):
            roll = rng.random()
            if roll < 0.3:
                parts.append(rng.choice(common))
            elif roll < 0.35:
                parts.append(str(rng.randint(0, 9999)))
            else:
                parts.append(rng.choices(words, weights)[0])
        sentence = " ".join(parts)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "?", "!", ","]))
    return lines


def build_tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=512,
    )


def build_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    # Drawn in float32 (seeded), stored in bfloat16: the dtype vLLM on CPU serves it in.
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def fingerprint(out: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name != "fingerprint.txt"):
        digest.update(path.relative_to(out).as_posix().encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus(random.Random(SEED)))
    tokenizer.save_pretrained(out)
    model = build_model(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    (out / "fingerprint.txt").write_text(
        f"sha256:{fingerprint(out)} vocab={len(tokenizer)} params={params}\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
