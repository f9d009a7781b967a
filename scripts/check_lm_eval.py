"""lm-evaluation-harness against ``lm serve``: the harness's own client, checked against the model.

    pip install "lm_eval[api]"                         # the harness (not a dependency of lm)
    python scripts/check_lm_eval.py                    # a demo-shaped model, random weights; ~1 minute
    python scripts/check_lm_eval.py --checkpoint runs/demo/run

It starts the real server (``lm serve``, a subprocess) and runs ``lm_eval --model
local-completions`` on it with ``tokenizer_backend=remote`` (the server's ``/tokenize``,
``/detokenize`` and ``/tokenizer_info``: the harness counts and cuts text in the model's own
tokens, no Hugging Face tokenizer needed), on two tasks written here from local files (nothing is
downloaded):

1. **multiple choice** (``loglikelihood``: token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``):
   every choice's log-likelihood and ``is_greedy`` as the harness logged them, against the sum of
   the model's own ``log_softmax`` (over the tokenizer's tokens, which the server samples from) over
   the continuation's tokens, computed here without the server;
2. **generation** (``generate_until``: greedy, cut at ``until``): the harness's answers against
   ``lm.generate.generate`` on the same prompt, decoded and cut at the same stop string.

Prints one table; exits 1 if any number disagrees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CONTEXTS = ["Once upon a time, there was a little", "Lily and Tom went to the", "The little dog was very",
            "One day, Ben saw a big", "Mia had a red", "The sun was hot and the", "Sam wanted to play with his",
            "In the park, there was a"]
CHOICES = [" dog", " park", " ball", " happy", " tree"]
UNTIL = "."


def write_tasks(d: Path) -> None:
    with open(d / "docs.jsonl", "w") as f:
        for i, context in enumerate(CONTEXTS):
            choices = CHOICES[i % 5:] + CHOICES[:i % 5]
            f.write(json.dumps({"context": context, "choices": choices[:3], "label": 0}) + "\n")
    common = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'docs.jsonl'}
test_split: test
doc_to_text: "{{{{context}}}}"
"""
    (d / "lm_choice.yaml").write_text(common + """task: lm_choice
output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (d / "lm_generate.yaml").write_text(common + f"""task: lm_generate
output_type: generate_until
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["{UNTIL}"]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
""")


def samples(out: Path, task: str) -> list[dict]:
    path = next(out.rglob(f"samples_{task}_*.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="a run to serve (default: a demo-shaped random model)")
    args = ap.parse_args()
    lm_eval = shutil.which("lm_eval") or (str(Path(sys.executable).parent / "lm_eval")
                                          if (Path(sys.executable).parent / "lm_eval").exists() else None)
    if lm_eval is None:
        sys.exit('check_lm_eval.py: lm_eval is not installed here; pip install "lm_eval[api]"')

    import torch

    from lm.generate import generate, load_model_and_tokenizer
    from lm.serve.process import free_port, start_server

    work = Path(tempfile.mkdtemp(prefix="check_lm_eval_"))
    if args.checkpoint is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_serve import make_run

        run = make_run(work)
    else:
        run = Path(args.checkpoint)
    try:
        loaded = load_model_and_tokenizer(run)  # a bad checkpoint: its own one-line message
        model, tok = loaded.model.eval(), loaded.tokenizer
        if getattr(model.config, "architecture", "decoder_lm") != "decoder_lm":
            raise ValueError(f"--checkpoint: {run} is an {model.config.architecture} model; the harness scores "
                             "a language model's text")
    except ValueError as e:
        shutil.rmtree(work)
        sys.exit(f"check_lm_eval.py: {e}")
    write_tasks(work)
    proc, url = start_server(["--checkpoint", str(run), "--model-name", "lm", "--quiet"], free_port(),
                             stderr=subprocess.PIPE, text=True)
    try:
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        r = subprocess.run([lm_eval, "--model", "local-completions", "--model_args",
                            f"base_url={url}/v1/completions,model=lm,tokenizer_backend=remote,num_concurrent=1",
                            "--tasks", "lm_choice,lm_generate", "--include_path", str(work),
                            "--output_path", str(work / "out"), "--log_samples"],
                           capture_output=True, text=True, env=env, timeout=1800)
    finally:
        proc.terminate()
        proc.wait(60)
    if r.returncode != 0:
        print(r.stdout[-3000:] + r.stderr[-3000:])
        sys.exit(f"check_lm_eval.py: lm_eval exited {r.returncode}")

    rows, ok = [], True
    worst, greedy_same, n_choice = 0.0, 0, 0
    for s in samples(work / "out", "lm_choice"):
        for choice, (loglikelihood, is_greedy) in zip(s["doc"]["choices"], s["filtered_resps"]):
            # the harness's split (its _encode_pair): the whole text encoded, the context's tokens first
            ids, context = tok.encode(s["doc"]["context"] + choice), tok.encode(s["doc"]["context"])
            with torch.no_grad():  # over the tokenizer's tokens: the ids the server samples from
                logp = torch.log_softmax(model(torch.tensor([ids]))[0, :, :tok.vocab_size].float(), dim=-1)
            want = sum(logp[t - 1, ids[t]].item() for t in range(len(context), len(ids)))
            want_greedy = all(logp[t - 1].argmax().item() == ids[t] for t in range(len(context), len(ids)))
            worst = max(worst, abs(float(loglikelihood) - want))
            greedy_same += (is_greedy in (True, "True")) == want_greedy
            n_choice += 1
    ok &= worst < 1e-4 and greedy_same == n_choice
    rows += [("multiple choice: choices scored", f"{n_choice}"),
             ("max |log-likelihood - model's log_softmax sum|", f"{worst:.1e}"),
             ("is_greedy as the model's argmax", f"{greedy_same} of {n_choice}")]
    equal, n_gen = 0, 0
    for s in samples(work / "out", "lm_generate"):
        prompt = tok.encode(s["doc"]["context"])
        new = generate(model, prompt, 24, temperature=0.0, eos_id=tok.eot_id, vocab_size=tok.vocab_size)
        want = tok.decode([t for t in new if t != tok.eot_id]).split(UNTIL)[0]
        got = s["resps"][0][0]
        equal += got == want
        n_gen += 1
        if got != want:
            print(f"generation differs for {s['doc']['context']!r}: harness {got!r}, generate {want!r}")
    ok &= equal == n_gen
    rows.append(("generation: answers equal to lm.generate's, cut at the stop", f"{equal} of {n_gen}"))
    results = json.loads(next((work / "out").rglob("results_*.json")).read_text())["results"]
    rows.append(("the harness's acc on lm_choice", f"{results['lm_choice']['acc,none']:.3f}"))
    print(f"\n## lm-evaluation-harness (local-completions, remote tokenizer) against lm serve ({run})\n")
    print("| check | value |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    if ok:
        shutil.rmtree(work)
    print("\nall checks pass" if ok else f"\nSOME CHECKS FAIL (the harness's samples: {work / 'out'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
