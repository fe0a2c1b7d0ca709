"""Review: what a host reports to the poller is not bounded.

`_get_json` reads any size of answer (parsed on the event loop every poll), and `parse_models`
keeps every id and alias of any length: a host reporting 100k models makes each of them "known"
(so `fleet.knows` admits them as model names for the route), lists them all in
`/_crossbar/hosts`, and on a router each loaded one costs two more requests per poll round."""

from __future__ import annotations

from crossbar.hosts import parse_models

BOUND = 4096  # any fixed bound would do; today there is none


def test_a_host_reporting_100k_models_is_not_believed_whole() -> None:
    body = {"data": [{"id": f"model-{i}-" + "x" * 200, "aliases": [f"alias-{i}"]} for i in range(100_000)]}
    models = parse_models(body)
    assert len(models) <= BOUND, len(models)


def test_a_reported_model_id_is_bounded_in_length() -> None:
    models = parse_models({"data": [{"id": "m" * 1_000_000}]})
    assert all(len(name) <= 256 for name in models), max(map(len, models))
