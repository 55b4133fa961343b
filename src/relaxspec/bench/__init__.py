"""Benchmarking: ``relaxspec bench`` (every method on the same images: speed, TV certificate,
offline quality; :mod:`.run`, :mod:`.report`, :mod:`.config`) and ``relaxspec eval`` (N images per
class through ``relaxspec generate``, sharded, then FID; :mod:`.eval`)."""
