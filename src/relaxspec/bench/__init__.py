"""Benchmarking as library functions: every method on the same images (:mod:`.run`), the
tables, plots and offline quality (:mod:`.report`), the named method specs (:mod:`.config`),
forward costs (:mod:`.cost`), per-step op and sync counts (:mod:`.counting`). The commands
``relaxspec bench`` and ``relaxspec eval`` are :mod:`relaxspec.cli.bench` and
:mod:`relaxspec.cli.eval`."""
