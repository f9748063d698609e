"""The heads' training data: offline text chunks hold out whole sources, and the committed
records round-trip through their archives."""
from __future__ import annotations

import gzip
import json

from specserve.engine.model.chat import ChatTemplate
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR
from specserve.engine.model.tokenizer import TextTokenizer
from specserve.modelbuild.distill import records, texts


def _text_records(kind: str, split: str, budget: int) -> list[dict]:
    target = DEFAULT_MODEL_DIR / "target"
    return texts.records(ChatTemplate.from_model_dir(target), TextTokenizer(target), kind, split, budget)


def test_text_chunks_hold_out_whole_sources_and_fit_their_size() -> None:
    for kind in ("readme", "code"):
        train, heldout = _text_records(kind, "train", 20_000), _text_records(kind, "heldout", 20_000)
        assert train and heldout
        assert not {r["source"] for r in train} & {r["source"] for r in heldout}
        for record in train + heldout:
            assert texts.MIN_CHUNK_TOKENS <= len(record["response_ids"]) <= texts.CHUNK_TOKENS
            assert record["kind"] == "text" and record["split"] in ("train", "heldout")
        assert len({r["job"] for r in train}) == len(train)


def test_text_records_are_the_same_on_every_run() -> None:
    assert _text_records("code", "train", 5_000) == _text_records("code", "train", 5_000)


def test_records_pack_and_unpack_to_the_same_lines(tmp_path) -> None:
    data, committed, fresh = tmp_path / "data", tmp_path / "committed", tmp_path / "fresh"
    data.mkdir()
    lines = [json.dumps({"job": f"j{i}", "prompt_ids": [1, 2], "response_ids": [i]}) for i in (3, 1, 2)]
    (data / "responses.jsonl").write_text("\n".join(lines) + "\n")
    assert records.pack(data, committed) == ["responses.jsonl"]
    first = (committed / "responses.jsonl.gz").read_bytes()
    assert records.pack(data, committed) == ["responses.jsonl"] and (committed / "responses.jsonl.gz").read_bytes() == first
    assert records.unpack(fresh, committed) == ["responses.jsonl"]
    assert sorted((fresh / "responses.jsonl").read_text().splitlines()) == sorted(lines)
    (fresh / "responses.jsonl").write_text("kept\n")
    assert records.unpack(fresh, committed) == [] and (fresh / "responses.jsonl").read_text() == "kept\n"


def test_the_committed_records_are_token_ids_of_the_default_model() -> None:
    vocab = TextTokenizer(DEFAULT_MODEL_DIR / "target").vocab_size
    for name in records.FILES:
        archive = records.COMMITTED / f"{name}.gz"
        assert archive.is_file(), f"{archive} is not committed"
        rows = [json.loads(line) for line in gzip.decompress(archive.read_bytes()).decode().splitlines()]
        assert {r["split"] for r in rows} == {"train", "heldout"}
        for row in rows:
            ids = row["prompt_ids"] + row["response_ids"]
            assert ids and all(0 <= t < vocab for t in ids)
