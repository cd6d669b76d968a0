from pathlib import Path

import pytest
import yaml

from rayhf.errors import RayhfError
from rayhf.graph import load_graph

REPO = Path(__file__).resolve().parents[3]


def test_ppo_graph_order_and_edges():
    g = load_graph(REPO / "graphs" / "ppo.yaml")
    assert g.order[0] == "actor_gen"
    assert set(g.order[1:4]) == {"rew_inf", "ref_inf", "critic_inf"}
    assert set(g.order[4:]) == {"actor_train", "critic_train"}
    assert ("actor_gen", "ref_inf") in g.edges and ("ref_inf", "actor_train") in g.edges
    assert ("actor_train", "critic_train") not in g.edges
    assert g.role_calls("actor") == ["actor_gen", "actor_train"]
    ref = g.by_name["ref_inf"]
    assert ref.interface_outputs() == {"logprobs": "ref_logprobs"}


def _write(tmp_path, calls, inputs=("prompts",)):
    p = tmp_path / "g.yaml"
    p.write_text(yaml.safe_dump({"name": "t", "inputs": list(inputs), "calls": calls}))
    return p


def _call(name, role="actor", kind="inference", inputs=(), outputs=(), **kw):
    return {
        "name": name,
        "role": role,
        "kind": kind,
        "interface": "ppo_actor",
        "inputs": list(inputs),
        "outputs": list(outputs),
        **kw,
    }


def test_key_nobody_produces_is_named(tmp_path):
    p = _write(
        tmp_path,
        [
            _call("a", inputs=["prompts"], outputs=["x"]),
            _call("b", inputs=["x", "ghost"], outputs=[]),
        ],
    )
    with pytest.raises(RayhfError, match="call 'b' reads key 'ghost'"):
        load_graph(p)


def test_cycle_is_reported(tmp_path):
    p = _write(
        tmp_path, [_call("a", inputs=["y"], outputs=["x"]), _call("b", inputs=["x"], outputs=["y"])]
    )
    with pytest.raises(RayhfError, match="cycle through calls: a, b"):
        load_graph(p)


def test_key_produced_twice(tmp_path):
    p = _write(
        tmp_path,
        [
            _call("a", inputs=["prompts"], outputs=["x"]),
            _call("b", inputs=["prompts"], outputs=["x"]),
        ],
    )
    with pytest.raises(RayhfError, match="key 'x' is produced by call 'b' and by call 'a'"):
        load_graph(p)


def test_remap_to_missing_key(tmp_path):
    p = _write(
        tmp_path, [_call("a", inputs=["prompts"], outputs=["x"], output_remap={"logprobs": "nope"})]
    )
    with pytest.raises(RayhfError, match="call 'a' output_remap maps 'logprobs' to 'nope'"):
        load_graph(p)


def test_unknown_role(tmp_path):
    g = load_graph(REPO / "graphs" / "ppo.yaml")
    with pytest.raises(RayhfError, match="call 'critic_inf' uses role 'critic'"):
        g.validate_roles({"actor", "ref", "reward"})


def test_unknown_field_in_graph(tmp_path):
    p = _write(tmp_path, [_call("a", inputs=["prompts"], outputs=["x"], colour="red")])
    with pytest.raises(RayhfError, match=r"calls\.0\.colour"):
        load_graph(p)


def test_split_after_a_key_runs_what_it_needs_first():
    graph = load_graph(REPO / "graphs" / "ppo.yaml")
    lead, rest = graph.split_after("scores")
    # the reward reads the generation; the reference, critic and trains run after the filter
    assert [c.name for c in lead.calls] == ["actor_gen", "rew_inf"]
    assert lead.inputs == graph.inputs
    assert set(rest.inputs) == {k for c in lead.calls for k in c.outputs}
    assert [c.name for c in lead.calls + rest.calls] == [c.name for c in graph.calls]
    assert "rew_inf" not in rest.order and rest.order[-1] in ("actor_train", "critic_train")


def test_every_shipped_graph_loads():
    shipped = sorted((REPO / "graphs").glob("*.yaml"))
    assert len(shipped) >= 6 and not (REPO / "rayhf" / "graphs").exists(), "one copy: graphs/"
    for path in shipped:
        assert load_graph(path).calls, path.name


def test_the_wheel_lists_every_package_and_carries_graphs_as_rayhf_graphs():
    """pyproject.toml names every package (graphs/ lives outside rayhf/, so no finder sees it):
    a package missing from the list would be missing from the wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {
        ".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "rayhf").rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == found | {"rayhf.graphs"}
    assert setuptools["package-dir"] == {"rayhf.graphs": "graphs"}
    assert setuptools["package-data"]["rayhf.graphs"] == ["*.yaml"]
    data = [
        p for p in (REPO / "rayhf").rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
    ]
    unlisted = [
        str(p.relative_to(REPO))
        for p in data
        if not any(
            p.parent.relative_to(REPO).as_posix().replace("/", ".") == package
            and any(p.match(pattern) for pattern in patterns)
            for package, patterns in setuptools["package-data"].items()
        )
    ]
    assert unlisted == [], "data files the wheel would leave out: list them in package-data"


def test_a_config_s_built_in_graph_resolves_in_a_checkout(tmp_path, monkeypatch):
    from rayhf.config.experiment import resolve_path

    monkeypatch.chdir(tmp_path)  # not the checkout: graphs/ppo.yaml is not relative to it
    assert resolve_path("graphs/ppo.yaml") == REPO / "graphs" / "ppo.yaml"
