"""Two decodes at once on one model (issue 52, item 6): the decoding state a model carries (its KV
cache, the loop's buffers and noise slots, kept with the model) serves one decode at a time, so a
decode holds the model's lock (:func:`relaxspec.caching.decode_lock`) and a second one, from
another thread, waits for it. Each then gets what it gets alone: the same tokens for its seed."""

from __future__ import annotations

import threading

import torch

from relaxspec.decoding import decode
from relaxspec.methods import MethodOptions
from relaxspec.sampling import SamplingConfig
from helpers.engine import fake_vq, markov_pair

#: What each thread decodes, several times in a row: (method options, seed).
WORK = [(dict(method="lantern", draft="chain", depth=3, k=8, delta=0.3), 1), (dict(method="ar"), 2),
        (dict(method="sd", draft="chain", depth=2), 3), (dict(method="gsd", window=4), 4)]
ROUNDS = 3


def test_threads_decoding_on_one_model_each_get_what_they_get_alone():
    model, drafter = markov_pair(n_layer=1)
    vq = fake_vq(model.config.vocab_size)
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0)

    def run(options: dict, seed: int) -> torch.Tensor:
        return decode(model, torch.arange(2), sampling, MethodOptions(**options), drafter=drafter, vq=vq,
                      generator=torch.Generator().manual_seed(seed)).tokens

    alone = [run(options, seed) for options, seed in WORK]
    results: dict[int, list] = {i: [] for i in range(len(WORK))}
    start = threading.Barrier(len(WORK))

    def work(i: int) -> None:
        start.wait()
        for _ in range(ROUNDS):
            try:
                results[i].append(run(*WORK[i]))
            except Exception as error:  # a crash of one decode is a result too
                results[i].append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(WORK))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a decode never finished"
    wrong = [f"{WORK[i][0]['method']} round {r}: {got!r}" if isinstance(got, Exception)
             else f"{WORK[i][0]['method']} round {r}: other tokens than alone"
             for i, got_all in results.items() for r, got in enumerate(got_all)
             if isinstance(got, Exception) or not torch.equal(got, alone[i])]
    assert not wrong, "\n".join(wrong)
