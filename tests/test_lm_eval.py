"""lm-evaluation-harness against a one-rank ``torchtsp serve`` equals lm-evaluation-harness in process.

Two tiny tasks from local jsonl files (a multiple-choice one: loglikelihoods; a generate_until one: greedy
generations) run through lm-eval's ``local-completions`` model (token-id prompts over HTTP, as lm-eval sends
them) and through its in-process ``hf`` model (transformers, float32, CPU) on the same random tiny Hugging Face
Llama checkpoint. Offline: no hub access.
"""

from __future__ import annotations

import json

import pytest

from helpers import tiny_hf_llama
from test_serve import Server

pytestmark = pytest.mark.multirank

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("httpx")
pytest.importorskip("transformers")

CONTEXT = 128
MC = [  # question, choices, answer (the model is random: the answer only has to exist)
    ("the cat sat on the", [" mat", " dog", " park bench"], 0),
    ("a bird flew over", [" the park", " a cat", " the"], 1),
    ("the dog ran to", [" the mat and then", " a bird"], 0),
    ("on a mat the", [" cat sat", " bird flew", " dog ran", " mat"], 2),
]
GEN = ["the cat sat on", "a bird flew over the park and then", "the dog ran", "on a mat the cat"]


def _tasks(folder) -> None:
    """The two tasks' jsonl files and YAMLs, in ``folder`` (a TaskManager include_path)."""
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                             for q, c, a in MC))
    (folder / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "target": "x"}) + "\n" for p in GEN))
    common = "test_split: test\ndataset_path: json\n"
    (folder / "tsp_mc.yaml").write_text(
        f"task: tsp_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (folder / "tsp_gen.yaml").write_text(
        f"task: tsp_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            env.setenv(name, "1")
        env.setenv("TOKENIZERS_PARALLELISM", "false")
        yield from _served(tmp_path_factory)


def _served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    folder = root / "tiny-llama"
    tiny_hf_llama(folder, max_position_embeddings=CONTEXT)
    tasks = root / "tasks"
    tasks.mkdir()
    _tasks(tasks)
    # One rank: lm-eval's client and the server's API are what is checked here; the 2-rank path's logprobs and
    # greedy text over HTTP are test_serve_logprobs.py's and test_serve.py's, against transformers.
    server = Server(folder, root / "server.log", "--max-model-len", str(CONTEXT), "--timeout-s", "60", ranks=1)
    try:
        server.wait_ready()
        yield server, folder, tasks
    finally:
        server.close()


def _task_manager(tasks):
    """Only this folder's two tasks: lm-eval's own task YAMLs are not indexed (measured on this 2-core machine under
    other load, one TaskManager took 313 s with them and 1.4 s without; the module builds four)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks), include_defaults=False)


def _evaluate(task: str, tasks, model: str, model_args: dict) -> list[dict]:
    """lm-eval's logged samples of ``task``, in document order."""
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], batch_size=1,
                                  task_manager=_task_manager(tasks), log_samples=True,
                                  bootstrap_iters=0, random_seed=0)
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def _both(setup, task: str) -> tuple[list[dict], list[dict]]:
    server, folder, tasks = setup
    remote = {"base_url": server.url + "/v1/completions", "model": "tiny-llama", "tokenizer_backend": "huggingface",
              "tokenizer": str(folder), "tokenized_requests": True, "max_length": CONTEXT, "max_retries": 1,
              "num_concurrent": 1}
    local = {"pretrained": str(folder), "dtype": "float32", "device": "cpu"}
    return _evaluate(task, tasks, "local-completions", remote), _evaluate(task, tasks, "hf", local)


def test_generate_until_through_the_server_equals_lm_eval_in_process(setup):
    served, in_process = _both(setup, "tsp_gen")
    assert len(served) == len(in_process) == len(GEN)
    got = [s["resps"][0][0] for s in served]
    want = [s["resps"][0][0] for s in in_process]
    assert got == want
    assert any(g.strip() for g in got), got  # something was generated, not only empty answers


def test_loglikelihoods_through_the_server_equal_lm_eval_in_process(setup):
    """Every choice's loglikelihood (lm-eval asks the server for echo=True, logprobs=1 on token-id prompts)."""
    served, in_process = _both(setup, "tsp_mc")
    assert len(served) == len(in_process) == len(MC)
    for s, h, (_, choices, _) in zip(served, in_process, MC):
        got = [float(r[0][0]) for r in s["resps"]]
        want = [float(r[0][0]) for r in h["resps"]]
        assert len(got) == len(want) == len(choices)
        assert max(abs(a - b) for a, b in zip(got, want)) < 2e-3, (got, want)
        assert [bool(r[0][1]) for r in s["resps"]] == [bool(r[0][1]) for r in h["resps"]]  # greedy or not
