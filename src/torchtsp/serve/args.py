"""The flags of ``torchtsp serve`` (no heavy imports: ``torchtsp --help`` stays fast)."""

from __future__ import annotations

import argparse

from ..argtypes import length
from ..kv_layouts import DEFAULT_BLOCK_SIZE, KV_LAYOUT_HELP, KV_LAYOUTS
from ..schemes import AXES, SCHEMES
from ..timeouts import SERVE_TIMEOUT_S, SHUTDOWN_GRACE_S
from .reasoning import REASONING_PARSERS


def serve_axes() -> tuple[str, ...]:
    """The mesh axes of the schemes ``serve`` runs (the registry's, in its order): one degree flag each."""
    used = {axis for name in SCHEMES.servable() for axis in SCHEMES[name].axes}
    return tuple(axis for axis in AXES if axis in used)


def add_serve_arguments(p: argparse.ArgumentParser, presets, schedules) -> None:
    add = p.add_argument
    source = p.add_mutually_exclusive_group()
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face Llama checkpoint folder (with its tokenizer.json)")
    source.add_argument("--checkpoint", metavar="RUN", help="a training run folder or one of its step folders")
    source.add_argument("--preset", choices=list(presets), help="random weights of a preset shape (default: tiny)")
    add("--tokenizer", metavar="DIR", help="folder of the tokenizer.json to use (default: the model's own)")
    add("--scheme", default="tsp", choices=list(SCHEMES.servable()), help="parallel scheme (default: tsp)")
    for axis in serve_axes():
        add(f"--{axis}", type=int, help=f"{axis} degree (the scheme's axis; default: every rank)")
    add("--nproc", type=int, help="local ranks to spawn when not under torchrun (default: the degree, or 1)")
    add("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype (default: float32)")
    add("--seed", type=int, default=0, help="init seed of --preset weights (default: 0)")
    add("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    add("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    add("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on /v1/* (default: the "
        "TORCHTSP_API_KEY environment variable; none: no key)")
    add("--served-model-name", metavar="NAME", help="the model's name in the API (default: the checkpoint "
        "folder's or preset's name)")
    add("--max-num-seqs", type=int, default=16, help="sequences in the running batch at most (default: 16)")
    add("--max-batch", type=int, dest="max_num_seqs", default=argparse.SUPPRESS, help="alias of --max-num-seqs")
    add("--max-num-batched-tokens", type=length, default=2048, help="tokens one engine step runs at most: prompt "
        "chunks plus one per decoding sequence (default: 2048)")
    add("--kv-cache-mb", type=float, metavar="MIB", help="KV cache per rank, in MiB (default: 256 on CPU; on GPU "
        "90%% of the device memory free after the weights)")
    add("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per KV cache block on each rank (default: {DEFAULT_BLOCK_SIZE})")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse the cached "
        "blocks of a prompt's longest cached prefix (default: on)")
    add("--max-queue", type=int, default=256, help="requests waiting for the batch before 429 (default: 256); a "
        "request with more prompts than this gets 400")
    add("--max-model-len", type=length, help="prompt + new tokens per request at most (default: the model's "
        "max_seq_len); a request must also fit the whole KV cache (--kv-cache-mb)")
    add("--chat-template", metavar="FILE", help="jinja2 chat template (default: the tokenizer's chat_template.jinja, "
        "else tokenizer_config.json's)")
    add("--prefill-chunk", type=length, help="prefill at most this many tokens of one prompt per step (default: "
        "no cap but --max-num-batched-tokens)")
    add("--schedule", choices=schedules, default="auto", help="tsp: weights move or activations move; auto picks "
        "per phase by tokens in flight (default)")
    add("--shutdown-grace-s", type=float, default=SHUTDOWN_GRACE_S, help="on SIGTERM / SIGINT nothing new is "
        "admitted and waiting requests fail at once (503); running ones may finish for this many seconds, then end "
        f"with an error (default: {SHUTDOWN_GRACE_S:g})")
    add("--kv-layout", choices=KV_LAYOUTS, default="auto", help=KV_LAYOUT_HELP)
    add("--tool-call-parser", metavar="NAME", help="how tool_choice auto reads tool calls in the model's output, "
        "by model family: hermes (<tool_call>{json}</tool_call>: Qwen, Hermes), llama3_json (Llama 3.1's JSON "
        "calls), mistral ([TOOL_CALLS][...]), openai (GPT-OSS's harmony calls; with --reasoning-parser gpt_oss) "
        "(default: none; tool_choice auto is then refused, required and a named function still work)")
    add("--reasoning-parser", choices=REASONING_PARSERS, help="chat answers carry the model's reasoning in "
        "message.reasoning_content (delta.reasoning_content when streamed), apart from content, by model family: "
        "qwen3 (<think>...</think>), deepseek_r1 (reasoning until </think>), gpt_oss (harmony's analysis channel; "
        "its final channel is content) (default: none, the text is untouched); it must match the chat template")
    add("--enable-auto-tool-choice", action="store_true", help="accepted for vLLM's command lines: tool_choice "
        "auto is on whenever --tool-call-parser is given")
    add("--timeout-s", type=float, default=SERVE_TIMEOUT_S, help="seconds the ranks may go without answering "
        "before the server fails (503, requests fail): a decode step takes well under a second, so that long means "
        f"a hung rank, and clients should not wait longer (default: {SERVE_TIMEOUT_S:g})")
