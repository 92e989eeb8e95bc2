"""The ``transformers`` half of the export checks: export a checkpoint, load the folder, compute
logits, greedy and beam continuations and token ids (a ``ts_lm``), masked LM logits and encoder
hidden states (a ``ts_mlm``), translation logits and greedy and beam translations (a ``ts_transformer``).

``tests/interop/test_hf_export.py`` calls these functions in-process (the installed transformers)
and through :class:`FloorWorker`, a ``python -m tests.helpers.hf_side`` process whose
``PYTHONPATH`` starts with the floor copy ``scripts/install.sh`` puts in ``$VENV/transformers-floor``
(the pins of ``torchscale_fairseq/interop/transformers-floor.txt``), so every check runs against
the newest and the lowest transformers the export supports. Arguments and results are tensors,
numbers, strings, lists and dicts (they cross the process boundary through ``torch.save``).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

REPO_ROOT = Path(__file__).resolve().parents[2]
FLOOR_PINS = REPO_ROOT / "torchscale_fairseq" / "interop" / "transformers-floor.txt"
FLOOR_DIR = Path(sys.prefix) / "transformers-floor"
TIMEOUT_S = 600


def floor_version() -> str:
    """The transformers release pinned in ``transformers-floor.txt``."""
    for line in FLOOR_PINS.read_text().splitlines():
        if line.startswith("transformers=="):
            return line.split("==", 1)[1].strip()
    raise ValueError(f"{FLOOR_PINS} pins no transformers==VERSION")


def version() -> dict[str, str]:
    """The transformers this process imports: its version and where it lives."""
    import transformers

    return {"version": transformers.__version__, "file": transformers.__file__}


def export(checkpoint: str, out: str, **options: Any) -> list[str]:
    """``ts-export-hf``'s export of ``checkpoint`` into ``out``; the files written."""
    from torchscale_fairseq.interop.hf_export import export_hf

    return export_hf(checkpoint, out, **options)


def load(folder: str) -> PreTrainedModel:
    """The exported causal LM (``trust_remote_code`` for the ``ts`` format), in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def forward(folder: str, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
            labels: torch.Tensor | None = None) -> dict[str, Any]:
    """The model's class name, its logits for ``tokens`` and, with ``labels``, its loss."""
    model = load(folder)
    with torch.no_grad():
        out = model(tokens, attention_mask=attention_mask, labels=labels)
    return {"class": type(model).__name__, "logits": out.logits, "loss": out.loss}


def masked_lm(folder: str, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """An exported ``ts_mlm``: ``AutoModelForMaskedLM``'s logits (with ``attention_mask``) and
    ``AutoModel``'s hidden states (padding from the pad tokens), with the classes loaded."""
    from transformers import AutoModel, AutoModelForMaskedLM

    mlm = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
    encoder = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = mlm(tokens, attention_mask=attention_mask).logits
        hidden = encoder(tokens).last_hidden_state
    return {"classes": [type(mlm).__name__, type(encoder).__name__], "logits": logits, "hidden": hidden}


def greedy(folder: str, prompt: torch.Tensor, max_new_tokens: int, pad: int, eos: int) -> torch.Tensor:
    """``generate()``'s greedy continuation of ``prompt`` (KV cache on, ``pad`` never chosen)."""
    model = load(folder)
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                              bad_words_ids=[[pad]], eos_token_id=eos, pad_token_id=pad)


def beam(folder: str, prefix: torch.Tensor, total: int, beams: int, pad: int, eos: int) -> dict[str, Any]:
    """``generate()``'s beam search (KV cache on, cache reordered between steps) set up as fairseq's
    ``SequenceGenerator`` searches an LM: from ``</s>``, ``prefix`` forced token by token and scored
    (fairseq counts it in the score and the length), ``</s>`` forced and scored as token ``total + 1``,
    ``pad`` never chosen, ``</s>`` not first, score = sum of log-probabilities / length (length
    penalty 1, ``</s>`` counted), done once ``beams`` hypotheses ended. The best hypothesis per
    row of ``prefix``: its tokens after ``</s>`` up to its ``</s>``, and its score."""
    from transformers import LogitsProcessorList

    from torchscale_fairseq.interop.hf_translate import forcing, hypotheses

    model = load(folder)
    start = torch.full((prefix.size(0), 1), eos)
    with torch.no_grad():
        out = model.generate(start, max_new_tokens=total + 1, do_sample=False, num_beams=beams, length_penalty=1.0,
                             early_stopping=True, min_new_tokens=0 if prefix.size(1) else 1,
                             bad_words_ids=[[pad]], eos_token_id=eos, pad_token_id=pad,
                             logits_processor=LogitsProcessorList([forcing(prefix, total, beams, eos)]),
                             return_dict_in_generate=True, output_scores=True)
    return {"tokens": hypotheses(out.sequences, eos), "scores": out.sequences_scores}


def seq2seq(folder: str, source: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    """An exported ``ts_transformer``: ``AutoModelForSeq2SeqLM``'s class name, its logits for
    ``decoder_input_ids`` ``</s>`` + ``target[:, :-1]`` (``labels`` ``target``), its loss and the
    generation config's search settings; ``AutoModel``'s decoder output (``hidden``) for them."""
    from transformers import AutoModel, AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    start = torch.full_like(target[:, :1], model.config.decoder_start_token_id)
    with torch.no_grad():
        out = model(input_ids=source, labels=target)
        encoded = base.encoder(source)
        hidden = base.decoder(torch.cat([start, target[:, :-1]], dim=1), encoded.last_hidden_state,
                              encoded.attention_mask)[0]
    settings = {k: getattr(model.generation_config, k) for k in (
        "decoder_start_token_id", "num_beams", "length_penalty", "early_stopping", "min_new_tokens", "suppress_tokens")}
    return {"class": type(model).__name__, "logits": out.logits, "loss": out.loss, "generation": settings,
            "hidden": hidden}


def translate(folder: str, source: torch.Tensor, total: int, beams: int) -> dict[str, Any]:
    """``generate()`` of an exported ``ts_transformer`` on ``source`` (KV cache for self- and
    cross-attention, reordered between beam steps) as ``hf_translate`` runs it: the folder's generation
    config (fairseq-generate's search), ``beams`` beams, length penalty 1, ``</s>`` forced as token
    ``total + 1``. Per row its best hypothesis (tokens up to and with its ``</s>``) and, with beams, its score."""
    from transformers import AutoModelForSeq2SeqLM

    from torchscale_fairseq.interop.hf_translate import translate as hf_translate

    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    tokens, scores = hf_translate(model, source, beams, 1.0, 0.0, total)
    return {"tokens": tokens, "scores": torch.tensor(scores)}


def tokenize(folder: str, texts: list[str]) -> list[dict[str, Any]]:
    """The folder's tokenizer: per text, its ids and their decoding without special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    return [{"ids": ids, "decoded": tokenizer.decode(ids, skip_special_tokens=True)}
            for ids in (tokenizer(text).input_ids for text in texts)]


FUNCTIONS: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (version, export, forward, masked_lm, greedy, beam, seq2seq, translate, tokenize)
}


class FloorWorker:
    """A ``python -m tests.helpers.hf_side`` process with the floor transformers first on its path,
    started at the first call (not earlier: its imports would compete with the tests running here);
    ``worker.NAME(**kwargs)`` runs ``NAME`` there and returns its result. Without the floor copy (or
    with another transformers than the pinned one) a call fails the test with one line saying to run
    ``bash scripts/install.sh``."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.log = scratch / "worker.log"
        self.count = 0
        self.process: subprocess.Popen | None = None

    @staticmethod
    def copy_problem() -> str | None:
        """Why the floor copy cannot be used (``None`` when it can)."""
        installed = FLOOR_DIR / "requirements.txt"
        if installed.is_file() and installed.read_text() == FLOOR_PINS.read_text():
            return None
        return f"the transformers floor copy {FLOOR_DIR} is missing or older than {FLOOR_PINS.name}: run bash scripts/install.sh"

    def start(self) -> None:
        """Start the worker; fail the test unless it runs the pinned transformers from the floor copy."""
        import pytest

        problem = self.copy_problem()
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FLOOR_DIR), str(REPO_ROOT)])}
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "tests.helpers.hf_side"], cwd=REPO_ROOT, env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        found = self.call("version", {})
        if found["version"] != floor_version() or not found["file"].startswith(str(FLOOR_DIR)):
            self.close()
            pytest.fail(f"the floor worker imports transformers {found['version']} from {found['file']}, not "
                        f"{floor_version()} from {FLOOR_DIR}: run bash scripts/install.sh", pytrace=False)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in FUNCTIONS:
            raise AttributeError(name)
        return lambda **kwargs: self.call(name, kwargs)

    def call(self, name: str, kwargs: dict[str, Any]) -> Any:
        """Run ``FUNCTIONS[name](**kwargs)`` in the worker."""
        if self.process is None:
            self.start()
        self.count += 1
        request = self.scratch / f"request-{self.count}.pt"
        torch.save({"fn": name, "kwargs": kwargs}, request)
        self.process.stdin.write(f"{request}\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], TIMEOUT_S)
        reply = self.process.stdout.readline().strip() if ready else ""
        if reply != str(request):
            self.close()
            tail = self.log.read_text()[-3000:]
            raise RuntimeError(f"the floor worker ended or gave no answer to {name}() within {TIMEOUT_S} s; "
                               f"the end of its log:\n{tail}")
        answer = torch.load(f"{request}.out", weights_only=True)
        if "error" in answer:
            raise RuntimeError(f"{name}() under the floor transformers failed:\n{answer['error']}")
        return answer["result"]

    def close(self) -> None:
        """End the worker (it exits when its input closes); the next call starts a new one."""
        if self.process is None:
            return
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def serve() -> None:
    """The worker's loop: each line of stdin names a request file ``{"fn", "kwargs"}``; the answer
    (``{"result"}`` or ``{"error"}``) goes to ``<request>.out``, then the request's name to stdout."""
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    # the libraries see no input (transformers' "run the custom code? [y/N]" prompt reads stdin) and
    # print into the log, not between the replies
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    torch.set_num_threads(1)  # tiny models; and the test process's threads share the cores
    for line in requests:
        path = line.strip()
        request = torch.load(path, weights_only=True)
        try:
            answer = {"result": FUNCTIONS[request["fn"]](**request["kwargs"])}
        except Exception:
            answer = {"error": traceback.format_exc()}
        torch.save(answer, f"{path}.out")
        replies.write(f"{path}\n")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    serve()
