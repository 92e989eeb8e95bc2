"""LM data preparation: fairseq round trip, split rule, wiki cleaning and one-line input errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fairseq.data import Dictionary, data_utils

from data_prep import prepare_lm, sample_lm, wiki_text
from torchscale_fairseq.data import gpt2_bpe

# Five documents (one paragraph per line); the split rule gives train = docs 0-2,
# valid = doc 3, test = doc 4.
DOCS = [
    ["The quick brown fox jumps over the lazy dog.", "A second paragraph, with numbers 1,234.5 and 2024."],
    ["Zürich, 東京 and naïve café — “quoted” 🙂", "  two leading spaces and a trailing one "],
    ["A literal <|endoftext|> is ordinary text here.", "Tabs\tand  double  spaces survive."],
    ["Validation document: Hello world"],
    ["Test document with an emoji 🚀 and Ελληνικά."],
]
EXPECTED_SPLITS = {"train": DOCS[:3], "valid": DOCS[3:4], "test": DOCS[4:]}


def _as_lines(docs: list[list[str]]) -> list[str]:
    lines: list[str] = []
    for i, doc in enumerate(docs):
        lines += ([""] if i else []) + doc
    return lines


def _write_docs(path: Path, docs: list[list[str]]) -> Path:
    path.write_text("\n\n".join("\n".join(doc) for doc in docs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dataset prepared with --force into a directory that already holds a user file."""
    root = tmp_path_factory.mktemp("prep")
    corpus = _write_docs(root / "corpus.txt", DOCS)
    out = root / "data-bin"
    out.mkdir()
    (out / "notes.txt").write_text("keep me\n")
    stats = prepare_lm.main(["--train-text", str(corpus), "--out-dir", str(out), "--force", "--workers", "1"])
    assert {split: stats[split]["docs"] for split in stats} == {"train": 3, "valid": 1, "test": 1}
    return out


def test_binarized_data_round_trips_to_the_original_text(prepared: Path) -> None:
    dictionary = Dictionary.load(str(prepared / "dict.txt"))
    assert len(dictionary) == 4 + 50257
    for split, docs in EXPECTED_SPLITS.items():
        dataset = data_utils.load_indexed_dataset(str(prepared / split), dictionary)
        expected = _as_lines(docs)
        assert dataset is not None and len(dataset) == len(expected)
        for item, line in zip(dataset, expected):
            assert item[-1].item() == dictionary.eos()
            ids = (item[:-1] - 4).tolist()
            assert ids == gpt2_bpe.encode(line, disallowed_special=())
            assert gpt2_bpe.decode(ids) == line
        assert (prepared / "raw" / f"{split}.txt").read_text(encoding="utf-8") == "".join(
            line + "\n" for line in expected
        )


def test_dictionary_maps_gpt2_id_plus_four(prepared: Path) -> None:
    dictionary = Dictionary.load(str(prepared / "dict.txt"))
    assert [dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk()] == [0, 1, 2, 3]
    hello = sample_lm.gpt2_to_fairseq(gpt2_bpe.encode("Hello world"), dictionary).tolist()
    assert hello == [15496 + 4, 995 + 4]
    assert sample_lm.fairseq_to_gpt2([15500, 999, dictionary.eos()], dictionary) == [15496, 995]
    assert dictionary.index("50256") == 50260


def test_force_keeps_unrelated_files_and_leaves_no_temp_dirs(prepared: Path) -> None:
    assert (prepared / "notes.txt").read_text() == "keep me\n"
    assert not [p for p in prepared.parent.iterdir() if p.name.startswith(".data-bin.tmp-")]


def test_sampling_through_a_fairseq_hub(prepared: Path) -> None:
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.hub_utils import GeneratorHubInterface

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        [str(prepared), "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "1",
         "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2",
         "--tokens-per-sample", "32", "--cpu"],
    )  # fmt: skip
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    torch.manual_seed(0)
    hub = GeneratorHubInterface(cfg, task, [task.build_model(cfg.model)]).eval()
    prompt_ids = gpt2_bpe.encode("Hello world")
    ids = sample_lm.sample_ids(hub, prompt_ids, max_len=5, topk=5, seed=3)
    assert ids[: len(prompt_ids)] == prompt_ids
    assert 0 < len(ids) - len(prompt_ids) <= 5 and all(0 <= i < 50257 for i in ids)
    assert sample_lm.sample_ids(hub, prompt_ids, max_len=5, topk=5, seed=3) == ids
    assert isinstance(sample_lm.continue_prompt(hub, "Hello world", max_len=3), str)
    with pytest.raises(ValueError, match="empty"):
        sample_lm.sample_ids(hub, [], max_len=3)
    with pytest.raises(ValueError, match="at most 31"):
        sample_lm.sample_ids(hub, [995] * 32, max_len=3)


def test_split_rule_is_by_document_and_deterministic() -> None:
    docs = [[f"doc {i}"] for i in range(40)]
    splits = prepare_lm.split_documents(docs, 0.05, 0.05)
    assert splits["train"] == docs[:36] and splits["valid"] == docs[36:38] and splits["test"] == docs[38:]
    with pytest.raises(SystemExit, match="too few"):
        prepare_lm.split_documents(docs[:2], 0.05, 0.05)


def test_explicit_split_files_are_used_as_given(tmp_path: Path) -> None:
    files = {split: _write_docs(tmp_path / f"{split}.txt", docs) for split, docs in EXPECTED_SPLITS.items()}
    args = prepare_lm.parse_args(
        [f"--{split}-text={path}" for split, path in files.items()] + ["--out-dir", str(tmp_path / "out")]
    )
    assert prepare_lm.load_corpus(args) == EXPECTED_SPLITS


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda d: ["--train-text", str(d / "missing.txt")], "missing.txt does not exist"),
        (lambda d: ["--train-text", str(_blank(d))], "has no text (empty corpus)"),
        (lambda d: ["--train-text", str(_corpus(d)), "--valid-text", str(_corpus(d))], "go together"),
        (lambda d: ["--wiki-dump", str(_corpus(d))], "not a readable MediaWiki XML dump"),
        (lambda d: ["--train-text", str(_corpus(d)), "--out-dir", str(_nonempty(d))], "pass --force"),
    ],
    ids=["missing-file", "empty-corpus", "valid-without-test", "bad-dump", "existing-out-dir"],
)
def test_bad_input_is_one_line_error_and_writes_nothing(tmp_path: Path, make_args, message: str) -> None:
    argv = make_args(tmp_path)
    if "--out-dir" not in argv:
        argv += ["--out-dir", str(tmp_path / "out")]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as err:
        prepare_lm.main(argv)
    text = str(err.value.code)
    assert text.startswith("error: ") and message in text and "\n" not in text
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def _blank(d: Path) -> Path:
    (d / "blank.txt").write_text("\n   \n\n", encoding="utf-8")
    return d / "blank.txt"


def _corpus(d: Path) -> Path:
    return _write_docs(d / "corpus.txt", DOCS)


def _nonempty(d: Path) -> Path:
    (d / "existing").mkdir(exist_ok=True)
    (d / "existing" / "model.pt").write_text("precious")
    return d / "existing"


def test_both_invocations_print_one_line_errors(repo_root: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.txt")
    out_dir = ["--out-dir", str(tmp_path / "out")]  # not the default: the demo may have filled it
    commands = [
        [sys.executable, "-m", "data_prep.prepare_lm", "--train-text", missing, *out_dir],
        [sys.executable, str(repo_root / "data_prep" / "prepare_lm.py"), "--train-text", missing, *out_dir],
    ]
    procs = [
        subprocess.Popen(cmd, cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd in commands
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and out == ""
        assert err.strip().splitlines()[-1] == f"error: --train-text file {missing} does not exist"


def test_gensim_wikipedia_extraction_is_clean() -> None:
    docs = wiki_text.wiki_documents(wiki_text.find_gensim_wiki_dump(), max_docs=4)
    assert len(docs) == 4
    assert docs[0][0].startswith("Anarchism is a political philosophy")
    text = "\n".join(p for doc in docs for p in doc)
    for markup in ("{{", "}}", "[[", "]]", "<ref", "</", "{|", "'''", "==", "http", "&nbsp;", "Category:"):
        assert markup not in text, markup
    assert all(p == p.strip() and p for doc in docs for p in doc)


def test_wiki_markup_cleaner_on_a_known_snippet() -> None:
    wikitext = (
        "{{Infobox person|name=Ada {{nowrap|Lovelace}}}}\n"
        "'''Ada Lovelace''' (born 10 December 1815{{efn|Old {{lang|la|style}}}}) was an [[England|English]] "
        "[[mathematician]]s.<ref name=a>{{cite book|title=X}}</ref> See [http://example.org the site].\n"
        "[[File:Ada.jpg|thumb|Portrait of [[Ada Lovelace|Ada]]]]\n"
        "{| class=wikitable\n|-\n| cell || {{flag|UK}}\n|}\n"
        "== Early life ==\n"
        "* She was born in London &amp; raised by her mother.<!-- hidden -->\n"
        "* [[London]]\n"
        "=== Empty section ===\n"
        "== References ==\n"
        "{{reflist}}\n"
        "[[Category:1815 births]]\n"
    )
    assert wiki_text.clean_wikitext(wikitext) == [
        "Ada Lovelace (born 10 December 1815) was an English mathematicians. See the site.",
        "Early life",
        "She was born in London & raised by her mother.",
    ]


def test_spm_vocab_ids_are_sentencepiece_ids_plus_one(tmp_path: Path) -> None:
    """--spm-vocab: the binarized ids are the ids of sentencepiece's own encoding of each line, + 1."""
    import sentencepiece as spm

    words = "the history of science art music river city north south war peace king queen".split()
    docs = [[" ".join(words[(d + i) % len(words)] for i in range(3 * d + 5)) + "." for _ in range(4)]
            for d in range(12)]
    corpus = _write_docs(tmp_path / "corpus.txt", docs)
    out = tmp_path / "data-bin"
    stats = prepare_lm.main(["--train-text", str(corpus), "--out-dir", str(out), "--spm-vocab", "40",
                             "--valid-fraction", "0.1", "--test-fraction", "0.1", "--workers", "1"])
    model = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    dictionary = Dictionary.load(str(out / "dict.txt"))
    assert len(dictionary) == 4 + model.get_piece_size() - 3  # sentencepiece's <unk> <s> </s> are fairseq's
    splits = prepare_lm.split_documents(docs, 0.1, 0.1)
    for split, split_docs in splits.items():
        dataset = data_utils.load_indexed_dataset(str(out / split), dictionary)
        lines = _as_lines(split_docs)
        assert len(dataset) == len(lines) and stats[split]["docs"] == len(split_docs)
        for item, line in zip(dataset, lines):
            assert (item[:-1] - 1).tolist() == model.encode(line)
            assert model.decode((item[:-1] - 1).tolist()) == line


def test_spm_vocab_too_small_is_one_line(tmp_path: Path) -> None:
    corpus = _write_docs(tmp_path / "corpus.txt", DOCS)
    with pytest.raises(SystemExit, match="--spm-vocab 2 is too small"):
        prepare_lm.main(["--train-text", str(corpus), "--out-dir", str(tmp_path / "out"), "--spm-vocab", "2"])
    assert not (tmp_path / "out").exists()
