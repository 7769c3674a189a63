"""The plan table (body of ``--dry-run``): read it back and compare with the plan."""

from hybrid_core.placement import PlacementSpec


def table_rows(text):
    """GPU rows of the rendered table as {gpu: {role: cell}}, plus the header's role labels."""
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("GPU |"))
    labels = [c.strip() for c in header.split("|")[1:]]
    rows = {}
    for line in lines[lines.index(header) + 2 :]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 2:
            break
        if cells[0].isdigit():
            rows[int(cells[0])] = dict(zip(labels, cells[1:]))
    return labels, rows


def test_table_shows_every_gpu_role_rank_and_fraction():
    plan = PlacementSpec.from_ranges(
        {"actor": "0-7", "rollout": "0-7", "reference": "0-7", "reward": "0-7"}, gpus_per_node=8
    ).plan()
    text = plan.render()
    labels, rows = table_rows(text)
    assert labels == ["actor", "rollout", "reference", "reward"]
    assert sorted(rows) == list(range(8))
    for gpu, cells in rows.items():
        assert set(cells.values()) == {f"#{gpu} 0.25"}
    assert text.startswith("placement: 8 GPUs on 1 node (8 GPUs per node)")
    summary = {line.split()[0]: line for line in text.splitlines()[-4:]}
    assert summary["actor"].split()[-2:] == ["GPUs", "0-7"]  # the GPUs it shares with other roles


def test_table_shows_engines_across_their_gpus_empty_cells_and_nodes():
    plan = PlacementSpec.from_ranges(
        {"actor": "0-7", "rollout": "0-7", "reference": "0-3"}, tp={"rollout": 4}, gpus_per_node=4
    ).plan()
    text = plan.render()
    _, rows = table_rows(text)
    for gpu in range(8):
        assert rows[gpu]["rollout"] == f"#{gpu // 4} {0.3333 if gpu < 4 else 0.5}"
        assert rows[gpu]["reference"] == ("-" if gpu >= 4 else f"#{gpu} 0.3333")
    assert "node 1 (GPUs 4-7)" in text
    rollout_line = next(line for line in text.splitlines() if line.startswith("rollout "))
    assert rollout_line.split()[:5] == ["rollout", "2", "4", "0-7", "0.3333-0.5"]  # workers, tp, GPUs, fractions


def test_table_is_plain_ascii_and_compact():
    plan = PlacementSpec.from_ranges({"actor": "0-47", "rollout": "0-47"}, tp={"rollout": 4}, gpus_per_node=8).plan()
    text = plan.render()
    assert text.isascii()
    assert max(len(line) for line in text.splitlines() if "|" in line) < 80
