"""Train the shipped models: a byte-level BPE tokenizer and two small Llama models on Python code and chat.

    python models/train.py        # -> models/pagedserve-coder-small (primary), models/pagedserve-coder-tiny

The corpus is the .py sources of the running interpreter's standard library (no network, nothing
committed); every 20th file, in sorted order, is held out for validation. The same files give chat
pairs in the ChatML template (chat_pairs.py: "Write a function that <docstring line>" -> the function).
Each model is trained on 256-token windows, half of each batch from the code stream (random windows,
every token scored) and half from the chat stream (windows that begin with a conversation, only the
answers scored), with AdamW and a cosine schedule, bounded by steps and by wall seconds. The primary
learns the data's tokens; the tiny fallback then learns the shipped primary's next-token distribution
(TEACHERS), which makes it the primary's draft model for speculative decoding.
The time boxes (18 + 10 minutes; under 30 minutes in all with the tokenizer and evaluation) bind
first on a 2-core machine: ~1.0 s per small step, so the primary's 1100-step limit is out of reach
there, while the tiny model's 1000 steps (~0.44 s each with the primary's forward) fit when the
machine is idle. The schedule is then annealed by elapsed time, so a busy machine yields fewer tokens
and worse models; where the step limits bind the run is bit-reproducible.
"""

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path
from typing import NamedTuple

# Read by OpenMP when torch loads. On a shared 2-core machine spinning worker threads wait on each
# other at every op while the other processes hold the cores: measured 3-10x slower steps than
# sleeping waits (and than 1 thread) under load.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from chat_pairs import defines_function, function_pairs  # noqa: E402  (models/, the script's directory)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

MODELS_DIR = Path(__file__).resolve().parent
IGNORE = -100  # the label of a token that is not scored (cross_entropy's ignore_index)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]  # ids 0..3, in this order
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# test suites and the GUI/2to3 trees are large and repetitive; they would dominate a corpus this small
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
# no trailing newline: byte-level BPE merges "\n" with the indentation after it, so a prompt ending in a
# bare "\n" token is a boundary the model has rarely seen (it then continues at column 0)
SAMPLE_PROMPT = "def read_lines(path):"
# the README's chat example; the report gives how many of CHAT_SAMPLES seeded answers parse as Python
CHAT_PROMPT = "Write a function that reads a file and returns its lines"
CHAT_SAMPLES = 10

# name -> LlamaConfig shape; saved as models/pagedserve-coder-{name}. Param counts include the tied embedding.
ARCHS = {
    # 11.0 M params
    "small": dict(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=1024,
        tie_word_embeddings=True,
    ),
    # 2.4 M params
    "tiny": dict(
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        tie_word_embeddings=True,
    ),
}


# student -> teacher: the fallback learns the primary's next-token distribution (from the shipped primary's
# weights, trained first in the same run or already in --out-dir), so that as the primary's draft model its
# tokens are the ones the primary keeps (speculative decoding, docs/serving.md)
TEACHERS = {"tiny": "small"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=MODELS_DIR)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    # small batches: this run is data-starved (< 1M tokens), where more updates per token win
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--chat-rows", type=int, default=2, help="rows of each batch drawn from the chat stream")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.3,
        help="the shipped default sampling temperature (generation_config.json), also the chat check's",
    )
    p.add_argument("--small-steps", type=int, default=1100)
    p.add_argument("--small-seconds", type=float, default=1080.0, help="wall-clock cap on training")
    # half the tiny model's at twice its width (measured: at 3e-3 it did worse per token than the tiny one)
    p.add_argument("--small-lr", type=float, default=1.5e-3)
    p.add_argument("--tiny-steps", type=int, default=1000)
    p.add_argument("--tiny-seconds", type=float, default=600.0, help="wall-clock cap on training")
    p.add_argument("--tiny-lr", type=float, default=3e-3)
    p.add_argument("--val-windows", type=int, default=128, help="256-token windows scored for val_loss")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--models", default=",".join(ARCHS), help="comma-separated subset of: " + ", ".join(ARCHS))
    args = p.parse_args()
    if unknown := set(args.models.split(",")) - ARCHS.keys():
        p.error(f"unknown models {sorted(unknown)}; choose from {list(ARCHS)}")
    return args


def load_corpus(val_every: int = 20) -> tuple[list[str], list[str]]:
    """Returns (train_texts, val_texts): whole files, split by file so validation is unseen code."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not EXCLUDED_DIRS & set(p.relative_to(root).parts))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    train = [t for i, t in enumerate(texts) if i % val_every != 0]
    val = [t for i, t in enumerate(texts) if i % val_every == 0]
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def encode(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One flat stream of ids, files separated by <|endoftext|>. Shape [num_tokens], int64."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(tokenizer: PreTrainedTokenizerFast, arch: dict, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **arch,
    )
    return LlamaForCausalLM(config)


def lr_at(progress: float, peak: float, warmup: float = 0.05, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay to floor * peak; progress in [0, 1]."""
    if progress < warmup:
        return peak * progress / warmup
    t = min(1.0, (progress - warmup) / (1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * t)))


class Stream(NamedTuple):
    ids: torch.Tensor  # [num_tokens] int64
    labels: torch.Tensor  # [num_tokens]: the id where it is scored, IGNORE where not (a chat request)
    starts: torch.Tensor | None  # where a training window may begin (None: anywhere)


def code_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> Stream:
    ids = encode(tokenizer, texts)
    return Stream(ids, ids, None)


def chat_stream(tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[str, str]]) -> Stream:
    """Each pair as the serving chat template renders it (the request with the generation prompt, as a
    server encodes it, then the answer and <|im_end|>); only the answers are scored, and windows begin
    where a conversation does."""
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": request}], add_generation_prompt=True, tokenize=False
        )
        for request, _ in pairs
    ]
    answers = [answer + "<|im_end|>\n" for _, answer in pairs]
    encode_all = tokenizer.backend_tokenizer.encode_batch
    ids: list[int] = []
    labels: list[int] = []
    starts: list[int] = []
    for prompt, answer in zip(
        encode_all(prompts, add_special_tokens=False),
        encode_all(answers, add_special_tokens=False),
        strict=True,
    ):
        starts.append(len(ids))
        answer_ids = [*answer.ids, tokenizer.eos_token_id]
        ids += prompt.ids + answer_ids
        labels += [IGNORE] * len(prompt.ids) + answer_ids
    return Stream(torch.tensor(ids), torch.tensor(labels), torch.tensor(starts))


def windows(
    stream: Stream, rows: int, seq_len: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """rows random windows of seq_len + 1 tokens: (ids, labels), each [rows, seq_len + 1]."""
    last = len(stream.ids) - seq_len - 1
    if stream.starts is None:
        starts = torch.randint(0, last, (rows,), generator=gen)
    else:
        allowed = stream.starts[stream.starts < last]
        starts = allowed[torch.randint(0, len(allowed), (rows,), generator=gen)]
    at = starts[:, None] + torch.arange(seq_len + 1)
    return stream.ids[at], stream.labels[at]


def train(
    model: LlamaForCausalLM,
    code: Stream,
    chat: Stream,
    args: argparse.Namespace,
    max_steps: int,
    max_seconds: float,
    peak_lr: float,
    teacher: torch.nn.Module | None = None,
) -> dict:
    """Next-token cross-entropy on the data; with a teacher, the KL divergence from the teacher's next-token
    distribution instead, at the same scored positions."""
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norms: weight decay would shrink them
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(args.seed)
    start, step, loss = time.monotonic(), 0, torch.tensor(float("nan"))
    while step < max_steps:
        elapsed = time.monotonic() - start
        if elapsed >= max_seconds:
            break
        # the schedule follows whichever budget runs out first, so a time-boxed run still anneals
        progress = max(step / max_steps, elapsed / max_seconds)
        for group in opt.param_groups:
            group["lr"] = lr_at(progress, peak_lr)
        (code_ids, code_labels), (chat_ids, chat_labels) = (
            windows(code, args.batch_size - args.chat_rows, args.seq_len, gen),
            windows(chat, args.chat_rows, args.seq_len, gen),
        )
        ids, labels = torch.cat([code_ids, chat_ids]), torch.cat([code_labels, chat_labels])
        scored, count = (
            lm_loss(model, ids, labels) if teacher is None else distill_loss(model, teacher, ids, labels)
        )
        loss = scored / count
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            print(
                f"  step {step} loss {loss.item():.3f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{time.monotonic() - start:.0f}s",
                flush=True,
            )
    seconds = time.monotonic() - start
    return {
        "steps": step,
        "max_steps": max_steps,
        "max_seconds": max_seconds,
        "train_seconds": round(seconds, 1),
        "final_train_loss": round(loss.item(), 4),
        "train_tokens": step * args.batch_size * args.seq_len,
        "stopped_by": "steps" if step >= max_steps else "time",
    }


def lm_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(summed next-token cross-entropy, number of scored tokens) over [batch, seq_len + 1] windows."""
    logits = model(input_ids=ids[:, :-1]).logits  # [batch, seq_len, vocab]
    targets = labels[:, 1:].flatten()
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets, ignore_index=IGNORE, reduction="sum"
    )
    return total, int((targets != IGNORE).sum())


def distill_loss(
    model: torch.nn.Module, teacher: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(summed KL(teacher || model) of the next-token distributions, number of scored tokens) over
    [batch, seq_len + 1] windows, at the positions lm_loss scores."""
    scored = labels[:, 1:] != IGNORE
    with torch.no_grad():
        target = torch.log_softmax(teacher(input_ids=ids[:, :-1]).logits[scored].float(), dim=-1)
    log_probs = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[scored].float(), dim=-1)
    total = torch.nn.functional.kl_div(log_probs, target, log_target=True, reduction="sum")
    return total, int(scored.sum())


@torch.no_grad()
def val_loss(model: torch.nn.Module, stream: Stream, seq_len: int, num_windows: int) -> float:
    """Mean next-token loss (nats per scored token) over num_windows disjoint windows spread evenly over
    the val stream.

    Spread rather than the first ones: the first few files alone are not representative (measured 0.15
    nats apart on the same model).
    """
    model.eval()
    ids, labels = (
        t.unfold(0, seq_len + 1, seq_len) for t in (stream.ids, stream.labels)
    )  # [windows, seq_len + 1]
    chosen = torch.linspace(0, len(ids) - 1, min(num_windows, len(ids))).long()
    total, count = 0.0, 0
    for chunk_ids, chunk_labels in zip(ids[chosen].split(16), labels[chosen].split(16), strict=True):
        scored, n = lm_loss(model, chunk_ids, chunk_labels)
        total, count = total + scored.item(), count + n
    return total / count


@torch.no_grad()
def greedy_sample(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, max_new_tokens: int = 80
) -> str:
    ids = tokenizer(SAMPLE_PROMPT, return_tensors="pt").input_ids
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@torch.no_grad()
def chat_check(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, temperature: float, max_new_tokens: int = 160
) -> dict:
    """CHAT_SAMPLES seeded answers to CHAT_PROMPT: how many parse with ast.parse and define a function."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT_PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    answers, parsed = [], 0
    for seed in range(CHAT_SAMPLES):
        torch.manual_seed(seed)
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            eos_token_id=model.generation_config.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        answers.append(answer)
        parsed += defines_function(answer)
    return {
        "prompt": CHAT_PROMPT,
        "temperature": temperature,
        "samples": CHAT_SAMPLES,
        "parsed": parsed,
        "first_answer": answers[0],
    }


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path, temperature: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)  # bf16 halves the committed size
    tokenizer.save_pretrained(out)
    save_generation_config(tokenizer, out, temperature)


def save_generation_config(tokenizer: PreTrainedTokenizerFast, out: Path, temperature: float) -> None:
    """Stop at <|endoftext|> or <|im_end|>; sample at `temperature` (a server's default for requests that
    name none, as vLLM reads generation_config.json): at OpenAI's 1.0 models this small ramble."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, im_end],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=temperature,
    ).save_pretrained(out)


def run_one(name: str, tokenizer, streams: dict[str, Stream], args, corpus_info: dict) -> dict:
    steps, seconds, lr = (getattr(args, f"{name}_{k}") for k in ("steps", "seconds", "lr"))
    model = build_model(tokenizer, ARCHS[name], args.seed)
    params = sum(p.numel() for p in model.parameters())
    teacher = None
    if teacher_name := TEACHERS.get(name):
        teacher = AutoModelForCausalLM.from_pretrained(
            args.out_dir / f"pagedserve-coder-{teacher_name}", dtype=torch.float32
        ).eval()
    print(
        f"{name}: {params / 1e6:.2f} M params, up to {steps} steps / {seconds:.0f} s"
        + (f", distilled from {teacher_name}" if teacher else ""),
        flush=True,
    )
    stats = train(model, streams["code_train"], streams["chat_train"], args, steps, seconds, lr, teacher)
    out = args.out_dir / f"pagedserve-coder-{name}"
    save(model, tokenizer, out, args.temperature)
    # score what was shipped: the bf16 weights, reloaded from disk and upcast
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    report = {
        "architecture": "LlamaForCausalLM",
        "params": params,
        **stats,
        # final_train_loss: the KL divergence from this teacher's distribution where there is one
        "distilled_from": f"pagedserve-coder-{teacher_name}" if teacher else None,
        "val_loss": round(val_loss(shipped, streams["code_val"], args.seq_len, args.val_windows), 4),
        "chat_val_loss": round(val_loss(shipped, streams["chat_val"], args.seq_len, args.val_windows), 4),
        "uniform_baseline": round(math.log(len(tokenizer)), 4),
        "vocab_size": len(tokenizer),
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "peak_lr": lr,
        "seed": args.seed,
        "val_tokens_scored": min(args.val_windows, (len(streams["code_val"].ids) - 1) // args.seq_len)
        * args.seq_len,
        "chat_rows_per_batch": args.chat_rows,
        **corpus_info,
        "sample": {"prompt": SAMPLE_PROMPT, "continuation": greedy_sample(shipped, tokenizer)},
        "chat_check": chat_check(shipped, tokenizer, args.temperature),
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{name}: val_loss {report['val_loss']} chat {report['chat_val_loss']} "
        f"(uniform {report['uniform_baseline']}), chat answers parsed {report['chat_check']['parsed']}/{CHAT_SAMPLES}, "
        f"{report['train_tokens']} tokens in {report['train_seconds']} s",
        flush=True,
    )
    return report


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    train_texts, val_texts = load_corpus()
    train_pairs = [pair for text in train_texts for pair in function_pairs(text)]
    val_pairs = [pair for text in val_texts for pair in function_pairs(text)]
    tokenizer = train_tokenizer(train_texts + [request for request, _ in train_pairs], args.vocab_size)
    streams = {
        "code_train": code_stream(tokenizer, train_texts),
        "code_val": code_stream(tokenizer, val_texts),
        "chat_train": chat_stream(tokenizer, train_pairs),
        "chat_val": chat_stream(tokenizer, val_pairs),
    }
    corpus_info = {
        "corpus": "python stdlib .py sources (tests excluded), every 20th file held out; chat pairs "
        "'Write a function that <docstring line>' -> the function, from the same files",
        "chat_pairs_train": len(train_pairs),
        "chat_pairs_val": len(val_pairs),
        **{f"{name}_tokens": len(stream.ids) for name, stream in streams.items()},
    }
    print(
        f"tokenizer: {len(tokenizer)} tokens; "
        + ", ".join(f"{k} {v}" for k, v in corpus_info.items() if k != "corpus")
        + f" ({time.monotonic() - t0:.0f} s)",
        flush=True,
    )
    # the tokenizer is deterministic, so a model retrained alone still shares it with the other
    names = [n for n in ARCHS if n in args.models.split(",")]
    reports = {name: run_one(name, tokenizer, streams, args, corpus_info) for name in names}
    summary = ", ".join(f"{n} val_loss {r['val_loss']}" for n, r in reports.items())
    print(f"done in {time.monotonic() - t0:.0f} s: {summary}")


if __name__ == "__main__":
    main()
