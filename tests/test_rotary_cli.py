"""Rotary options from the command line, each checked against a model whose rotation is written here from its paper
with python math (no code of posbench's schemes), loaded with the run's trained weights (the command lines' jobs run
in this process: helpers.train_here, helpers.eval_here):

* ``posbench train scheme=rope scheme.rotary_fraction=0.25``: GPT-NeoX's partial rotary, trained and evaluated;
* ``posbench eval run=<an xpos run> scheme.scaling=yarn scheme.factor=4``: YaRN (the reference code's ramp) on xPos.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import eval_here, nll_with_scheme, train_here, yarn_frequencies

EVAL = ["eval.lengths=[32,64]", "eval.max_tokens=256"]


class NaiveRotary(torch.nn.Module):
    """Rotary positions for a GPT, from their formulas: pair (i, i + d/2) of a head's first d dimensions turned by
    angle p·f_i and scaled by m·ζ_i^(±(p − c)/B) (+ for a query, − for a key; ζ_i = 1 without xPos), the other
    dimensions unchanged. RoPE (Su et al. 2021), partial rotary (GPT-NeoX), xPos (Sun et al. 2022) with any
    frequencies f_i and YaRN's factor m."""

    has_bias = key_only_bias = contextual = weight_decay = False

    def __init__(self, rotated: int, freqs: list[float], mscale: float = 1.0, xpos: tuple | None = None):
        super().__init__()
        self.rotated, self.freqs, self.mscale, self.xpos = rotated, freqs, mscale, xpos

    def embed(self, x, pos):
        return x

    def rotation(self, pos, dtype):
        ps = pos.tolist()
        centre = (min(ps) + max(ps)) / 2
        half = self.rotated // 2
        tables = {}
        for sign in (1, -1):
            cos = [[0.0] * half for _ in ps]
            sin = [[0.0] * half for _ in ps]
            for t, p in enumerate(ps):
                for i in range(half):
                    zeta = 1.0 if self.xpos is None else (i / half + self.xpos[0]) / (1 + self.xpos[0])
                    scale = self.mscale * (1.0 if self.xpos is None else zeta ** (sign * (p - centre) / self.xpos[1]))
                    cos[t][i], sin[t][i] = scale * math.cos(p * self.freqs[i]), scale * math.sin(p * self.freqs[i])
            tables[sign] = (torch.tensor(cos, dtype=dtype), torch.tensor(sin, dtype=dtype))  # (T, d/2) each
        return tables

    def rotate(self, q, k, rotation):
        d, half = self.rotated, self.rotated // 2

        def turn(x, cos, sin):
            x1, x2 = x[..., :half], x[..., half:d]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., d:]), dim=-1)

        return turn(q, *rotation[1]), turn(k, *rotation[-1])

    def score_mod(self, score, h, q_pos, k_pos):
        return score


def test_partial_rotary_trains_from_the_command_line_as_gpt_neox_rotates(data_cache, tmp_path, torch_state):
    run = tmp_path / "partial"
    assert train_here(data_cache, run, "scheme=rope", "scheme.rotary_fraction=0.25", *EVAL)["status"] == "complete"
    rec = json.loads((run / "results.json").read_text())
    assert rec["label"] == "rope+partial0.25" and rec["config"]["scheme"]["rotary_fraction"] == 0.25
    dh = rec["config"]["model"]["d_model"] // rec["config"]["model"]["n_head"]  # 32: d = 8 dimensions turn
    d = 2 * max(1, int(0.25 * dh) // 2)
    want = nll_with_scheme(run, rec, NaiveRotary(d, [10000.0 ** (-2 * i / d) for i in range(d // 2)]))
    assert [r["nll"] for r in rec["results"]] == pytest.approx(want, rel=1e-5)


def test_yarn_on_an_xpos_run_from_the_command_line(data_cache, tmp_path, torch_state):
    run = tmp_path / "xpos"
    assert train_here(data_cache, run, "scheme=xpos", *EVAL)["status"] == "complete"
    assert eval_here(f"run={run}", *EVAL, "scheme.scaling=yarn", "scheme.factor=4")["results"]
    rec = json.loads((run / "eval-xpos_yarnx4_at_eval-nonoverlapping-validation-1.json").read_text())
    assert rec["label"] == "xpos (yarn×4 at eval)" and rec["scheme_overrides"] == {"scaling": "yarn", "factor": 4.0,
                                                                         "original_length": 32}
    trained = json.loads((run / "results.json").read_text())
    assert all(a != b for a, b in zip((r["nll"] for r in rec["results"]), (r["nll"] for r in trained["results"])))
    dh = rec["config"]["model"]["d_model"] // rec["config"]["model"]["n_head"]
    scheme = NaiveRotary(dh, yarn_frequencies(dh, 4.0, 32), 0.1 * math.log(4.0) + 1, xpos=(0.4, 512.0))
    assert [r["nll"] for r in rec["results"]] == pytest.approx(nll_with_scheme(run, rec, scheme), rel=1e-5)
