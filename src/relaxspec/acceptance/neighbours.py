"""Latent neighbourhoods of VQ codes for LANTERN (REFERENCE §1.2, arXiv 2410.03355).

For each code, the other codes sorted by L2 distance between codebook vectors. The official
LANTERN code uses the raw stored vectors (``geometry="raw"``); LlamaGen's quantiser looks codes up
after L2 normalisation, so ``geometry="normalised"`` measures distance between unit vectors (the
paper found L2 ~ cosine >> random neighbours). Computed once per tokenizer and cached.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
import numpy as np
from safetensors.torch import load_file, save_file

from relaxspec.errors import RelaxspecError
from relaxspec.files import NUMPY_MAGIC, missing_file

Geometry = Literal["raw", "normalised"]
# Distances are computed for this many (row, code) pairs at a time: 4M float64 = 32 MiB, so the
# 16384-code LlamaGen codebook never materialises its 2 GiB distance matrix.
CHUNK_ELEMENTS = 1 << 22


def _vectors(codebook: Tensor, geometry: str) -> Tensor:
    if not isinstance(codebook, Tensor) or codebook.dim() != 2 or codebook.shape[0] < 1:
        raise RelaxspecError("A codebook must be a tensor [vocab, dim].")
    if geometry not in ("raw", "normalised"):
        raise RelaxspecError(f"Neighbour geometry must be 'raw' or 'normalised', got {geometry!r}.")
    vectors = codebook.detach().to(device="cpu", dtype=torch.float64)
    if geometry == "normalised":
        vectors = F.normalize(vectors, dim=1)
    return vectors


def _check_k(k: int, vocab: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= vocab - 1:
        raise RelaxspecError(f"Neighbour count k must be an integer in [0, {vocab - 1}] (vocab - 1), got {k!r}.")


def _order_by_distance_then_index(dist: Tensor, index: Tensor) -> Tensor:
    """Reorder ``index [R, n]`` by (distance, code id): sort by id, then a stable sort by distance."""
    by_id = index.sort(dim=1)
    dist = dist.gather(1, by_id.indices)
    order = dist.sort(dim=1, stable=True).indices
    return by_id.values.gather(1, order)


def neighbour_table(codebook: Tensor, k: int, geometry: Geometry = "raw") -> Tensor:
    """The ``k`` nearest other codes of every code: ``[V, D]`` -> int64 ``[V, k]``.

    Row ``c`` lists codes ``!= c`` by increasing L2 distance between (raw or L2-normalised)
    codebook vectors, ties broken by the smaller code id, so a table for ``k`` is a prefix of the
    table for any larger ``k``. Rows are processed in chunks; each chunk keeps a few more than
    ``k`` candidates with ``topk`` and falls back to a full sort only for rows where a tie
    crosses the candidate boundary (duplicate codes), which keeps V = 16384 at a few seconds.
    """
    vectors = _vectors(codebook, geometry)
    vocab = vectors.shape[0]
    _check_k(k, vocab)
    out = torch.empty(vocab, k, dtype=torch.long)
    if k == 0:
        return out
    keep = min(vocab, k + 8)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // vocab)
    for start in range(0, vocab, rows_per_chunk):
        stop = min(vocab, start + rows_per_chunk)
        rows = torch.arange(start, stop)
        # Direct differences (not the |a|^2 + |b|^2 - 2ab expansion) so equal vectors tie exactly.
        dist = torch.cdist(vectors[start:stop], vectors, compute_mode="donot_use_mm_for_euclid_dist")
        dist[rows - start, rows] = float("inf")  # self excluded
        if keep >= vocab:
            ordered = _order_by_distance_then_index(dist, torch.arange(vocab).expand(stop - start, vocab))
        else:
            cand_dist, cand = dist.topk(keep, dim=1, largest=False, sorted=True)
            ordered = _order_by_distance_then_index(cand_dist, cand)
            # A code outside the candidates can tie with the k-th kept one only if the k-th
            # distance equals the largest candidate distance; sort those rows in full.
            kth = dist.gather(1, ordered[:, k - 1 : k]).squeeze(1)
            unsafe = kth >= cand_dist[:, -1]
            if bool(unsafe.any()):
                full = _order_by_distance_then_index(dist[unsafe], torch.arange(vocab).expand(int(unsafe.sum()), vocab))
                ordered = ordered.clone()
                ordered[unsafe] = full[:, :keep]
        out[start:stop] = ordered[:, :k]
    return out


def codebook_key(codebook: Tensor, geometry: Geometry) -> str:
    """A content hash of the codebook (dtype, shape, bytes) and the geometry."""
    data = codebook.detach().to("cpu").contiguous()
    digest = hashlib.sha256()
    digest.update(f"{data.dtype}|{tuple(data.shape)}|{geometry}|".encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def load_neighbour_file(path: str | os.PathLike, vocab: int, k: int) -> Tensor:
    """A neighbour table given as a file -> int64 ``[vocab, k]``, checked (one-line errors).

    The file is a NumPy ``.npy`` of integer code ids ``[vocab, >= k]``, each row the other codes
    nearest first: LANTERN's ``vq_distances/top_{V-1}_indices.npy`` (uint16 ``[V, V - 1]``, 537 MB
    for LlamaGen's 16384 codes) or a table of our own. Official LANTERN computes its table with
    ``torch.cdist`` (matrix-product distances) and ``topk``, so near ties may be ordered otherwise
    than :func:`neighbour_table` orders them (exact distances, ties by code id); the file lets a
    run use the very order the published numbers were measured with. Read memory-mapped, only the
    first ``k`` columns; pickled (object) arrays are refused, never loaded."""
    path = Path(path)
    where = f"--neighbours {path}"
    if missing_file(path):
        raise RelaxspecError(f"{where}: {missing_file(path)}")
    with open(path, "rb") as handle:
        if handle.read(len(NUMPY_MAGIC)) != NUMPY_MAGIC:
            raise RelaxspecError(f"{where}: not a .npy file (no NumPy header): save the table with numpy.save")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as err:  # an object array (a pickle) or a damaged header
        pickled = "allow_pickle" in str(err) or "Python objects" in str(err)
        why = "it holds Python objects (a pickle), never loaded" if pickled else str(err)
        raise RelaxspecError(f"{where}: not a NumPy table of code ids: {why}") from None
    except OSError as err:
        raise RelaxspecError(f"{where}: cannot be read as a .npy file ({err})") from None
    if not isinstance(array, np.ndarray) or array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
        raise RelaxspecError(f"{where}: expected a 2-D integer array [codes, neighbours], got "
                             f"{getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}")
    if array.shape[0] != vocab:
        raise RelaxspecError(f"{where}: a table for {array.shape[0]} codes; this model's codebook has {vocab}")
    if array.shape[1] < k:
        raise RelaxspecError(f"{where}: {array.shape[1]} neighbours per code, fewer than k = {k}")
    table = torch.from_numpy(np.ascontiguousarray(array[:, :k]).astype(np.int64))
    if k == 0:
        return table
    if int(table.min()) < 0 or int(table.max()) >= vocab:
        raise RelaxspecError(f"{where}: code ids must lie in [0, {vocab - 1}]")
    codes = torch.arange(vocab)[:, None]
    if (table == codes).any():
        first = int((table == codes).any(1).nonzero()[0])
        raise RelaxspecError(f"{where}: code {first} lists itself as a neighbour (a table excludes each code's own id)")
    ordered = table.sort(dim=1).values
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        first = int((ordered[:, 1:] == ordered[:, :-1]).any(1).nonzero()[0])
        raise RelaxspecError(f"{where}: code {first} lists a neighbour twice")
    return table


def default_cache_dir() -> Path:
    """Where neighbour tables are cached: ``$RELAXSPEC_CACHE/neighbours``, by default
    ``~/.cache/relaxspec/neighbours``."""
    return Path(os.environ.get("RELAXSPEC_CACHE", Path.home() / ".cache" / "relaxspec")) / "neighbours"


def cached_neighbour_table(
    codebook: Tensor, k: int, geometry: Geometry = "raw", cache_dir: str | os.PathLike = "."
) -> Tensor:
    """:func:`neighbour_table`, stored as ``neighbours-<hash>-<geometry>-k<k>.safetensors``.

    The hash covers the codebook's bytes and the geometry; a cached table of width ``>= k`` is
    reused by slicing (tables are prefix-consistent, see :func:`neighbour_table`).
    """
    _vectors(codebook, geometry)  # validate before touching the disk
    _check_k(k, codebook.shape[0])
    key = codebook_key(codebook, geometry)
    directory = Path(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    pattern = re.compile(rf"neighbours-{key}-{geometry}-k(\d+)\.safetensors$")
    widths = sorted(
        int(match.group(1)) for path in directory.iterdir() if (match := pattern.match(path.name))
    )
    for width in widths:
        if width >= k:
            table = load_file(str(directory / f"neighbours-{key}-{geometry}-k{width}.safetensors"))["neighbours"]
            if table.shape == (codebook.shape[0], width):
                return table[:, :k].contiguous()
    table = neighbour_table(codebook, k, geometry)
    # Write-then-rename so a crashed or concurrent writer never leaves a truncated cache file.
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    os.close(fd)
    try:
        save_file({"neighbours": table}, tmp, metadata={"geometry": geometry, "k": str(k), "key": key})
        os.replace(tmp, directory / f"neighbours-{key}-{geometry}-k{k}.safetensors")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return table
