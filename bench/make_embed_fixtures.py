"""Make the embedding and reranking oracle fixtures in tests/fixtures/embed/.

Run with the references' python (torch, transformers, tokenizers):
    REF=$(../shared/tools/setup-refs.sh); $REF bench/make_embed_fixtures.py

As bench/make_arch_fixtures.py does (whose converter helpers it uses: the llama-cpp-python
0.3.36 sdist's `convert_hf_to_gguf.py`, unmodified, with that sdist's gguf-py), it builds tiny
random Hugging Face models locally in float32, saves them, converts them to F32 GGUF, and
stores HF's answers:

  bert            BertModel with a WordPiece tokenizer (uncased) trained on a few lines, and
                  sentence-transformers' pooling config (modules.json, 1_Pooling/config.json:
                  mean), which the converter reads into bert.pooling_type
  bert-cls        the same model with CLS pooling
  roberta-rerank  RobertaForSequenceClassification (one label) with a byte-level BPE tokenizer:
                  a cross-encoder, its head written as `cls` / `cls.output`

<name>.npz: `texts` (the texts, as a unicode array), `ids` (every text's HF input ids, each
with [CLS]/[SEP] or <s>/</s>, concatenated) and `lengths`; for the embedders `embeddings`
(n_texts, n_embd), HF's last hidden state pooled over the attention mask as the pooling config
says (mean or the first token) and L2-normalised, as sentence-transformers computes it; for
the reranker `query`, `documents`, the pairs' ids and `scores` (HF's logits of each
(query, document) pair, `<s> q </s></s> d </s>`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_arch_fixtures import TEXT, convert, import_converter, llama_cpp_dir  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "embed"

# 1 to 100+ tokens: accents, unknown words and characters, punctuation, mixed case, digits
TEXTS = [
    "fox",
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve résumé: ÉLÈVE über straße!",
    "Zxqvw blorptastic ☃ 北京 — who knows?",
    "  spaces\tand\nnewlines   everywhere  ",
    "Numbers like 12, 345 and 6789; dates 2024-05-17 and times 10:30.",
    " ".join(TEXT.split()[:90]),
    "She said, \"It's fine, we'll go tomorrow.\" He didn't agree... (but they'd decided)",
]
QUERY = "Where does the dog sleep?"
DOCUMENTS = [
    "Die Katze schläft auf dem Sofa.",
    "The lazy dog sleeps in the sun.",
    "Numbers like 12 and 345.",
    "Mixture of experts routes every token to a few feed-forward networks chosen by a router.",
    "dog",
]


def randomize(model) -> None:
    """Wider random weights than HF's init (matrices N(0, 1/fan_in), embeddings N(0, 1), norms
    around identity with random biases), so that different texts embed far apart."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
            elif p.ndim == 1:
                p.normal_(0.0, 0.1)
            elif "embeddings" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def write_wordpiece(hf_dir: Path) -> dict:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertTokenizerFast
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(TEXT.splitlines(), trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials,
                                                                         show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = BertTokenizerFast(tokenizer_object=tok, do_lower_case=True, unk_token="[UNK]", sep_token="[SEP]",
                             pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    fast.save_pretrained(hf_dir)
    return dict(vocab_size=tok.get_vocab_size(), pad_token_id=tok.token_to_id("[PAD]"))


def write_bpe(hf_dir: Path) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import RobertaTokenizerFast
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT.splitlines(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
    fast = RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    fast.save_pretrained(hf_dir)
    return dict(vocab_size=tok.get_vocab_size(), pad_token_id=1, bos_token_id=0, eos_token_id=2)


def write_pooling(hf_dir: Path, mode: str) -> None:
    (hf_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (hf_dir / "1_Pooling").mkdir()
    (hf_dir / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": mode == "cls",
         "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
         "pooling_mode_lasttoken": False}))


def build(name: str, hf_dir: Path):
    import torch
    import transformers
    hf_dir.mkdir(parents=True)
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if name == "roberta-rerank":
        cls = transformers.RobertaForSequenceClassification
        config = transformers.RobertaConfig(**shape, **write_bpe(hf_dir), max_position_embeddings=258,
                                            type_vocab_size=1, num_labels=1, layer_norm_eps=1e-5)
    else:
        cls = transformers.BertModel
        config = transformers.BertConfig(**shape, **write_wordpiece(hf_dir), max_position_embeddings=256,
                                         type_vocab_size=2, layer_norm_eps=1e-12)
        write_pooling(hf_dir, "cls" if name == "bert-cls" else "mean")
    config.architectures = [cls.__name__]
    torch.manual_seed(4321)
    model = cls(config).float().eval()
    randomize(model)
    model.save_pretrained(hf_dir)
    model = cls.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    return model, transformers.AutoTokenizer.from_pretrained(hf_dir)


def answers(name: str, model, tokenizer) -> dict:
    import torch
    if name == "roberta-rerank":
        enc = [tokenizer(QUERY, d) for d in DOCUMENTS]
        with torch.no_grad():
            scores = [float(model(torch.tensor([e["input_ids"]])).logits[0, 0]) for e in enc]
        ids = [e["input_ids"] for e in enc]
        print(f"  scores {np.round(scores, 4).tolist()}")
        return dict(query=np.array(QUERY), documents=np.array(DOCUMENTS), ids=np.concatenate(ids),
                    lengths=np.array([len(i) for i in ids]), scores=np.array(scores, np.float32))
    vectors, ids = [], []
    for text in TEXTS:
        e = tokenizer(text)
        with torch.no_grad():
            h = model(torch.tensor([e["input_ids"]]), token_type_ids=torch.tensor([e["token_type_ids"]])
                      ).last_hidden_state[0].double()
        v = h[0] if name == "bert-cls" else h.mean(0)
        vectors.append((v / v.norm()).numpy())
        ids.append(e["input_ids"])
    lengths = [len(i) for i in ids]
    print(f"  {len(TEXTS)} texts of {min(lengths)}..{max(lengths)} tokens; "
          f"unknown tokens: {sum(i.count(tokenizer.unk_token_id) for i in ids)}")
    cos = np.array(vectors) @ np.array(vectors).T
    print(f"  largest cosine between two texts {np.max(cos - 2 * np.eye(len(TEXTS))):.3f}")
    return dict(texts=np.array(TEXTS), ids=np.concatenate(ids), lengths=np.array(lengths),
                embeddings=np.array(vectors, np.float32))


def main() -> None:
    vendor = llama_cpp_dir()
    converter = import_converter(vendor)
    import torch
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for name, pre in (("bert", "bert-bge"), ("bert-cls", "bert-bge"), ("roberta-rerank", "gpt2")):
            print(f"== {name}")
            model, tokenizer = build(name, Path(work) / name)
            with contextlib.redirect_stdout(sys.stderr):
                convert(converter, Path(work) / name, OUT / f"{name}.gguf", pre)
            np.savez_compressed(OUT / f"{name}.npz", **answers(name, model, tokenizer))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
