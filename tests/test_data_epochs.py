"""Each epoch after the first reads a domain's files in a fresh order (seeded), and a
resume inside such an epoch continues exactly."""

from __future__ import annotations

from test_data import domains_corpus

from mta_repro.data import DataArgs, TokenizerArgs
from mta_repro.data.sources import DocStream


def _args(root):
    return DataArgs(root_dir=str(root), layout="domains", sources={"a": 1.0}, tokenizer=TokenizerArgs("bytes", None))


def _file_order(docs):
    out = []
    for d in docs:
        f = int(d.split("|")[1])
        if not out or out[-1] != f:
            out.append(f)
    return out


def test_file_order_is_shuffled_each_epoch_and_resumes_exactly(tmp_path):
    domains_corpus(tmp_path, {"a": (6, 2)})
    s = DocStream(_args(tmp_path), "a", 0, 1)
    docs = [s.next_doc() for _ in range(4 * 12)]
    orders = [_file_order(docs[e * 12 : (e + 1) * 12]) for e in range(4)]
    assert orders[0] == list(range(6))  # epoch 0: the corpus's order
    for o in orders[1:]:
        assert sorted(o) == list(range(6))  # every file once per epoch
    assert len({tuple(o) for o in orders}) == 4  # and a different order each epoch
    # Resume in the middle of epoch 2 (mid-file): the same documents follow.
    s2 = DocStream(_args(tmp_path), "a", 0, 1)
    for _ in range(12 * 2 + 5):
        s2.next_doc()
    st = s2.state_dict()
    s3 = DocStream(_args(tmp_path), "a", 0, 1)
    s3.load_state_dict(st)
    assert [s3.next_doc() for _ in range(15)] == docs[29:44]
    # The order depends on the data seed.
    other = DataArgs(**{**_args(tmp_path).__dict__, "seed": 7})
    s4 = DocStream(other, "a", 0, 1)
    docs4 = [s4.next_doc() for _ in range(4 * 12)]
    assert [_file_order(docs4[e * 12 : (e + 1) * 12]) for e in range(1, 4)] != orders[1:]
