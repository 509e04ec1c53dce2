"""The command line, through a real subprocess."""
import json
import subprocess
import sys
from pathlib import Path

import pytest


def npllama(*args, stdin=None, env_model=None):
    import os
    env = dict(os.environ)
    if env_model is not None:
        env["NPLLAMA_MODEL"] = str(env_model)
    return subprocess.run([sys.executable, "-m", "npllama", *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=600, env=env)


def one_line_error(r, code=None):
    assert r.returncode != 0 if code is None else r.returncode == code
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("npllama: error:"), r.stderr
    return lines[0]


def test_bad_flag_missing_file_bad_model(tmp_path, tiny_model_path):
    assert "--bogus" in one_line_error(npllama("run", "hi", "--bogus"), 2)
    assert "model file not found" in one_line_error(npllama("info", "-m", tmp_path / "nope.gguf"), 1)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 8)
    assert "truncated" in one_line_error(npllama("info", "-m", bad), 1)
    assert "invalid choice" in one_line_error(npllama("pull", "no-such-model"), 2)
    assert "threads must be" in one_line_error(npllama("bench", "-m", tiny_model_path, "-t", "0"), 1)
    assert "empty" in one_line_error(npllama("run", "", "-m", tiny_model_path), 1)


def test_info_on_tiny_model(tiny_model_path):
    r = npllama("info", "-m", tiny_model_path)
    assert r.returncode == 0, r.stderr
    for word in ("architecture   llama", "layers         2", "context        256", "F32", "tokenizer      gpt2"):
        assert word in r.stdout
    from npllama.kernels import cpu, quants_int8
    last = r.stdout.splitlines()[-1]
    assert last.startswith("cpu            ") and f" CPUs; int8 dots {quants_int8.DOT_ISA}, " in last
    assert last.endswith(f"AMX tiles {'yes' if cpu.AMX else 'no'}")


@pytest.mark.model
def test_run_chat_perplexity_bench(default_model_path, tmp_path):
    r = npllama("run", "What is the capital of France?", "--temp", "0", "-n", "16", env_model=default_model_path)
    assert r.returncode == 0 and "Paris" in r.stdout, r.stderr
    raw = npllama("run", "The capital of France is", "--raw", "--temp", "0", "-n", "4", env_model=default_model_path)
    assert raw.returncode == 0 and raw.stdout.strip() and raw.stdout != r.stdout
    chat = npllama("chat", "--temp", "0", "-n", "12", stdin="What is the capital of France?\n/reset\nHi\n/exit\n",
                   env_model=default_model_path)
    assert chat.returncode == 0 and "Paris" in chat.stdout and "new conversation" in chat.stderr
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. " * 20)
    ppl = npllama("perplexity", "-f", text, "-c", "32", env_model=default_model_path)
    assert ppl.returncode == 0 and ppl.stdout.startswith("perplexity "), ppl.stderr
    for mode in ("f32", "int8"):
        b = npllama("bench", "-p", "8", "-n", "4", "-r", "1", "--json", "--activations", mode,
                    env_model=default_model_path)
        figures = json.loads(b.stdout)
        assert figures["prefill_tok_s"] > 0 and figures["decode_tok_s"] > 0
    assert "max_tokens" in one_line_error(npllama("run", "hi", "-n", "-3", env_model=default_model_path), 1)


def test_import_npllama_loads_no_engine_and_every_name_resolves():
    """The package's names are imported at first use: `import npllama` (and the command line's
    own module) load neither Numba nor the engine; `from npllama import *` gives every name."""
    code = ("import sys, npllama, npllama.cli\n"
            "assert 'numba' not in sys.modules and 'npllama.engine' not in sys.modules, sorted(sys.modules)\n"
            "from npllama import *\n"
            "from npllama.model import load as model_load\n"
            "assert npllama.load is model_load and all(getattr(npllama, n) is not None for n in npllama.__all__)\n"
            "assert set(npllama.__all__) <= set(dir(npllama))\n"
            "try:\n    npllama.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "module 'npllama' has no attribute 'no_such_name'"


def test_type_checkers_see_the_same_names():
    """npllama/__init__.py's imports under TYPE_CHECKING (what editors and type checkers read)
    name exactly the modules and names that it imports at first use."""
    import ast
    from pathlib import Path

    import npllama
    tree = ast.parse(Path(npllama.__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    seen = {(("." * imp.level) + imp.module, alias.name) for imp in block.body for alias in imp.names}
    assert seen == {(module, name) for module, names in npllama._EXPORTS.items() for name in names}


EMBED = Path(__file__).parent / "fixtures" / "embed"


def test_embed_json_lines_and_npy(tmp_path):
    import numpy as np

    from npllama import load
    texts = ["the quick brown fox", "Héllo, wörld!", "a"]
    want = load(EMBED / "bert.gguf").embed(texts)
    src = tmp_path / "texts.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    r = npllama("embed", "-m", EMBED / "bert.gguf", src)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2]
    np.testing.assert_array_equal(np.array([line["embedding"] for line in lines], np.float32), want)
    out = tmp_path / "v.npy"
    r = npllama("embed", "-m", EMBED / "bert.gguf", "-", "-o", out, "--pooling", "cls", "--no-normalize",
                stdin="\n".join(texts))
    assert r.returncode == 0 and r.stdout == "", r.stderr
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (3, 64)
    np.testing.assert_array_equal(got, load(EMBED / "bert.gguf").embed(texts, pooling="cls", normalize=False))
    assert "line 2 of standard input is blank" in one_line_error(
        npllama("embed", "-m", EMBED / "bert.gguf", "-", stdin="a\n\nb\n"), 1)
    assert ".npy" in one_line_error(npllama("embed", "-m", EMBED / "bert.gguf", src, "-o", tmp_path / "v.txt"), 1)
    assert "is a reranker" in one_line_error(npllama("embed", "-m", EMBED / "roberta-rerank.gguf", src), 1)
    assert "302 tokens" in one_line_error(npllama("embed", "-m", EMBED / "bert.gguf", "-", stdin="fox " * 300), 1)


def test_rerank_json_lines(tmp_path):
    from npllama import load
    docs = ["the fox jumps over the dog", "stock prices fell today", "a quick brown fox"]
    want = load(EMBED / "roberta-rerank.gguf").rerank("what does the fox do", docs)
    r = npllama("rerank", "-m", EMBED / "roberta-rerank.gguf", "what does the fox do", "-", stdin="\n".join(docs))
    assert r.returncode == 0, r.stderr
    assert [json.loads(line) for line in r.stdout.splitlines()] == want
    r = npllama("rerank", "-m", EMBED / "roberta-rerank.gguf", "--top-n", "1", "what does the fox do", "-",
                stdin="\n".join(docs))
    assert [json.loads(line) for line in r.stdout.splitlines()] == want[:1]
    assert "not a reranker" in one_line_error(npllama("rerank", "-m", EMBED / "bert.gguf", "q", "-", stdin="d"), 1)
    assert "no documents" in one_line_error(npllama("rerank", "-m", EMBED / "bert.gguf", "q", "-", stdin=""), 1)


def test_serve_matryoshka_flag():
    from npllama.cli import build_parser
    parse = build_parser().parse_args
    assert parse(["serve"]).matryoshka is False
    assert parse(["serve", "--matryoshka"]).matryoshka is True
    assert parse(["serve", "--matryoshka", "64,128"]).matryoshka == [64, 128]
    assert "expected sizes such as" in one_line_error(npllama("serve", "--matryoshka", "big"), 2)
