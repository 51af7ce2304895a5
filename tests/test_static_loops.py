"""Main-loop analysis of the static report (tools.static_report.sass) on hand-written SASS.

Each fixture is ``nvdisasm -c`` output reduced to what the analysis reads: a ``.section .text.<name>``
line per function, labels, and ``/*addr*/ [@pred] OPCODE operands ;`` lines.
"""

from __future__ import annotations

import pytest

from tools.static_report import sass


def _fn(name: str, body: str, target: str = "sm_90a") -> str:
    return f"\t.target\t{target}\n\t.section\t.text.{name},\"ax\",@progbits\n{name}:\n" + _number(body)


def _number(body: str) -> str:
    """Instruction lines get consecutive addresses (16 bytes apart); label lines stay as they are."""
    out, addr = [], 0
    for line in body.strip().splitlines():
        line = line.strip()
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{addr:04x}*/                   {line}")
            addr += 16
    return "\n".join(out) + "\n"


def _loop(text: str, name: str = "k") -> dict:
    target, arch = sass.sass_arch(text)
    return sass.loop_metrics(sass.parse_sass(text)[name], arch)


# A TMA + wgmma K loop: mbarrier wait, two HGMMA.64x128x16 (2 × 64 = 128 tensor clocks per warp), wait
# depth 1; 9 instructions per iteration. After the loop, a depth-0 wait (not in the loop) and the trap
# loop ptxas appends after EXIT.
HGMMA_LOOP = _fn("k", """
    MOV R1, c[0x0][0x28] ;
    .L_x_0:
    SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
    WARPGROUP.ARRIVE ;
    HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
    HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
    WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
    UTMALDG.2D [UR16], [UR20] ;
    IADD3 R3, R3, 0x1, RZ ;
    ISETP.NE.AND P1, PT, R3, R4, PT ;
    @P1 BRA `(.L_x_0) ;
    WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    EXIT ;
    .L_x_1:
    BRA `(.L_x_1);
""")

# A Triton-style loop: register-A HGMMAs waited at depth 0, an integer division by a run-time value
# (I2F.U32.RP → MUFU.RCP → F2I → multiply-high), three CTA barriers, cp.async and operand staging.
DIV_LOOP = _fn("k", """
    MOV R1, c[0x0][0x28] ;
    .L_x_3:
    DEPBAR.LE SB0, 0x2 ;
    BAR.SYNC.DEFER_BLOCKING 0x0 ;
    LDS.128 R8, [R2] ;
    LDSM.16.M88.4 R12, [R3] ;
    I2F.U32.RP R5, UR6 ;
    MUFU.RCP R5, R5 ;
    VIADD R5, R5, 0xffffffe ;
    F2I.FTZ.U32.TRUNC.NTZ R5, R5 ;
    IMAD.HI.U32 R6, R5, R7, RZ ;
    STS.128 [R4], R8 ;
    BAR.SYNC.DEFER_BLOCKING 0x0 ;
    HGMMA.64x64x16.F32.BF16 R24, R12, gdesc[UR8], R24, gsb0 ;
    WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    LDGSTS.E.BYPASS.128 [R9], desc[UR4][R10.64] ;
    LDG.E.U16 R11, desc[UR4][R10.64] ;
    BAR.ARV 0x1, 0x100 ;
    BAR.SYNC.DEFER_BLOCKING 0x0 ;
    @!PT LDS RZ, [RZ] ;
    @P0 BRA `(.L_x_3) ;
    EXIT ;
""")

# Nested loops: an outer (persistent) tile loop around a K loop with one HGMMA that itself holds an
# mbarrier spin loop without MMAs; a retry block after EXIT jumps back into the K loop (not a loop).
NESTED = _fn("k", """
    MOV R1, c[0x0][0x28] ;
    .L_x_10:
    MOV R3, RZ ;
    .L_x_11:
    .L_x_12:
    SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
    @!P0 BRA `(.L_x_12) ;
    SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR5], R2 ;
    @!P2 BRA `(.L_x_20) ;
    .L_x_13:
    HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
    WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
    IADD3 R3, R3, 0x1, RZ ;
    ISETP.NE.AND P1, PT, R3, R4, PT ;
    @P1 BRA `(.L_x_11) ;
    STG.E.128 desc[UR4][R6.64], R24 ;
    ISETP.NE.AND P3, PT, R5, R7, PT ;
    BRA.U UP0, `(.L_x_10) ;
    EXIT ;
    .L_x_20:
    SYNCS.PHASECHK.TRANS64 P2, [UR5], R2 ;
    @!P2 BRA `(.L_x_20) ;
    BRA `(.L_x_13) ;
""")

# Two MMA loops one after the other: a projection loop with one HGMMA, then the main loop with two.
TWO_LOOPS = _fn("k", """
    .L_x_30:
    HGMMA.64x32x16.F32.BF16 R40, gdesc[UR8], R40, gsb0 ;
    WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
    @P0 BRA `(.L_x_30) ;
    .L_x_31:
    HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
    HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
    WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
    @P1 BRA `(.L_x_31) ;
    EXIT ;
""")

HMMA_LOOP = _fn("k", """
    .L_x_40:
    LDSM.16.MT88.4 R8, [R2] ;
    HMMA.16816.F32.BF16 R16, R8, R12, R16 ;
    HMMA.16816.F32.BF16 R20, R8, R14, R20 ;
    LDGSTS.E.BYPASS.128 [R9], desc[UR4][R10.64] ;
    @P0 BRA `(.L_x_40) ;
    EXIT ;
""", target="sm_80")


def test_parse_sass_fields():
    insns = sass.parse_sass(DIV_LOOP)["k"]
    assert insns[1] == sass.Insn(0x10, "", "DEPBAR.LE", "SB0, 0x2", (".L_x_3",))
    assert insns[-3].pred == "@!PT" and insns[-2].pred == "@P0" and insns[-2].args == "`(.L_x_3)"
    assert [i.base for i in insns[12:14]] == ["HGMMA", "WARPGROUP"]
    assert sass.sass_arch(DIV_LOOP) == ("sm_90a", 90) and sass.sass_arch(HMMA_LOOP) == ("sm_80", 80)


def test_hgmma_loop():
    m = _loop(HGMMA_LOOP)
    lp = m["loop"]
    assert lp["span"] == "0x10-0x90" and lp["instructions"] == 9
    assert lp["mma"] == 2 and lp["mma_shapes"] == {"HGMMA.64x128x16.F32.BF16": 2}
    assert lp["tensor_clocks"] == 128 and lp["issue_ratio"] == round(9 / 128, 3)
    assert lp["wgmma_waits"] == [1]  # the depth-0 wait after the loop is not in it
    assert lp["mem"] == {"UTMALDG": {"2D": 1}} and lp["mbarrier"] == {"SYNCS.PHASECHK": 1}
    assert (lp["bar_sync"], lp["int_div"], lp["sts"], lp["ldsm"], lp["hgmma_rs"], lp["inner_branches"]) == (0, 0, 0, 0, 0, 0)
    assert len(m["mma_loops"]) == 1  # the trap loop after EXIT holds no MMA


def test_depth0_wait_division_barriers_and_memory():
    lp = _loop(DIV_LOOP)["loop"]
    assert lp["instructions"] == 19 and lp["tensor_clocks"] == 32 and lp["issue_ratio"] == round(19 / 32, 3)
    assert lp["wgmma_waits"] == [0] and lp["cp_async_waits"] == [2]
    assert lp["int_div"] == 1
    assert lp["barriers"] == {"BAR.ARV": 1, "BAR.SYNC": 3} and lp["bar_sync"] == 3
    assert lp["mem"] == {"LDG": {"16": 1}, "LDGSTS": {"128": 1}, "LDS": {"128": 1, "32": 1}, "STS": {"128": 1},
                         "LDSM": {"16.M88.4": 1}}
    assert (lp["sts"], lp["ldsm"], lp["hgmma_rs"], lp["predicated_off"]) == (1, 1, 1, 1)


def test_nested_loops_take_the_innermost_mma_loop():
    insns = sass.parse_sass(NESTED)["k"]
    loops = sass.find_loops(insns)
    # the spin loop (2 → 3), the K loop (2 → 10), the tile loop (1 → 13), the retry spin loop; not the
    # jump back from the retry block (17 → 6: it spans EXIT)
    assert loops == [(2, 3), (2, 10), (1, 13), (15, 16)]
    m = sass.loop_metrics(insns, 90)
    lp = m["loop"]
    assert lp["span"] == "0x20-0xa0" and lp["instructions"] == 9 and lp["mma"] == 1
    assert lp["inner_branches"] == 2 and lp["mbarrier"] == {"SYNCS.PHASECHK": 2}
    assert [x["span"] for x in m["mma_loops"]] == ["0x20-0xa0"]


def test_two_mma_loops():
    m = _loop(TWO_LOOPS)
    assert m["loop"]["span"] == "0x30-0x60" and m["loop"]["mma"] == 2 and m["loop"]["tensor_clocks"] == 128
    assert m["mma_loops"] == [
        {"span": "0x0-0x20", "instructions": 3, "mma": 1, "tensor_clocks": 16.0, "issue_ratio": round(3 / 16, 3)},
        {"span": "0x30-0x60", "instructions": 4, "mma": 2, "tensor_clocks": 128.0, "issue_ratio": round(4 / 128, 3)}]


def test_hmma_loop_sm80():
    lp = _loop(HMMA_LOOP)["loop"]
    assert lp["mma"] == 2 and lp["tensor_clocks"] == 16 and lp["issue_ratio"] == round(5 / 16, 3)
    assert lp["wgmma_waits"] == [] and lp["mem"]["LDSM"] == {"16.MT88.4": 1}


def test_no_mma_loop():
    text = _fn("k", """
        .L_x_0:
        LDG.E R2, desc[UR4][R4.64] ;
        @P0 BRA `(.L_x_0) ;
        EXIT ;
    """)
    assert _loop(text) == {"loop": None, "mma_loops": []}
    assert sass.loop_metrics([], 90) == {"loop": None, "mma_loops": []}


@pytest.mark.parametrize("op, arch, clocks", [
    ("HGMMA.64x128x16.F32.BF16", 90, 64), ("HGMMA.64x64x16.F32", 90, 32), ("HGMMA.64x256x16.F16", 90, 128),
    ("HGMMA.64x64x8.F32.TF32", 90, 32), ("HGMMA.64x64x32.F32.E4M3.E4M3", 90, 32),
    ("HMMA.16816.F32.BF16", 80, 8), ("HMMA.1688.F32", 80, 4), ("HMMA.1688.F32.TF32", 80, 8),
    ("HMMA.1684.F32.TF32", 80, 4), ("HMMA.16816.F32.BF16", 90, 4), ("HMMA.1688.F32.TF32", 90, 4),
    ("IMMA.16832.S32.S8", 80, None), ("HGMMA.64x64x16.F32.BF16.SP", 90, None), ("FFMA", 90, None)])
def test_mma_clocks(op, arch, clocks):
    assert sass.mma_clocks(op, arch) == clocks


def test_unmodelled_mma_has_no_ratio():
    text = _fn("k", """
        .L_x_0:
        IMMA.16832.S32.S8 R16, R8, R12, R16 ;
        @P0 BRA `(.L_x_0) ;
    """, target="sm_80")
    lp = _loop(text)["loop"]
    assert lp["mma"] == 1 and lp["unmodelled_mma"] == 1 and lp["issue_ratio"] is None


# ------------------------------------------------------------------------------------- loop limits
from tools.static_report import loop_limits as LL  # noqa: E402


def _e(kernel="fprop", variant="3x3s1", dtype="bf16", arch="sm_90", roles=("default",), ratio=0.8, waits=(1,),
       div=0, bars=2, shapes=("m/layer1.0",), kind="triton", config="128x64x64 w8 s3", mma=4) -> dict:
    loop = {"issue_ratio": ratio, "wgmma_waits": list(waits), "int_div": div, "bar_sync": bars}
    return {"kind": kind, "kernel": kernel, "variant": variant, "dtype": dtype, "arch": arch, "roles": list(roles),
            "config": config, "shapes": list(shapes), "mma": mma, "loop": loop}


def test_limits_apply_by_kind_dtype_and_arch():
    names = lambda e: [(x.figure, x.limit) for x in LL.limits_for(e)]
    assert names(_e()) == [("issue_ratio", 1.0), ("wait_depth0", 0), ("int_div", 0), ("bar_sync", 2)]
    assert names(_e(kernel="wgrad_proj", dtype="fp16")) == names(_e())
    assert names(_e(arch="sm_80")) == [("issue_ratio", 1.0)]
    assert names(_e(dtype="fp32")) == [] and names(_e(kernel="dx")) == [] and names(_e(kind="anchor")) == []
    csrc = dict(kind="csrc", dtype="", kernel="GemmUniversal<…>")
    assert names(_e(config="sm90_conv_fprop.sm_90a.cubin", **csrc)) == [("issue_ratio", 0.6)]
    assert names(_e(config="sm90_conv_wgrad.sm_90a.cubin", **csrc)) == [("issue_ratio", 0.6)]
    assert names(_e(config="sm90_conv_dgrad.sm_90a.cubin", **csrc)) == [("issue_ratio", 0.3)]
    assert names(_e(config="sm90_conv_dgrad.sm_90a.cubin", mma=0, **csrc)) == []
    assert names(_e(config="conv_fprop.sm_80.cubin", arch="sm_80", **csrc)) == []
    assert LL.variant_key(_e()) == "triton fprop [3x3s1] bf16 sm_90"
    assert LL.variant_key(_e(kind="csrc", kernel="K<…>#2", dtype="fp16", config="c.cubin")) == "csrc c.cubin K<…> fp16 sm_90"


@pytest.mark.parametrize("bad, rule", [(dict(ratio=1.2), "issue_ratio"), (dict(waits=(1, 0)), "wait_depth0"),
                                       (dict(div=1), "int_div"), (dict(bars=3), "bar_sync")])
def test_each_rule_fails_without_baseline(bad, rule):
    assert LL.check_loops([_e()], {}) == ([], [])
    problems, _ = LL.check_loops([_e(**bad)], {})
    assert len(problems) == 1 and rule in problems[0] and "not in the baseline" in problems[0]
    assert "triton fprop [3x3s1] bf16 sm_90: default config" in problems[0]


def test_sm80_judges_the_ratio_alone():
    assert LL.check_loops([_e(arch="sm_80", waits=(0,), div=2, bars=5)], {}) == ([], [])
    assert len(LL.check_loops([_e(arch="sm_80", ratio=1.01)], {})[0]) == 1
    assert LL.check_loops([_e(dtype="fp32", ratio=9.0)], {}) == ([], [])  # fp32: reported only


def test_default_and_one_candidate_per_layer():
    """The default must meet a limit, and each layer needs at least one candidate that does."""
    ok_default = _e(ratio=0.9)
    a_bad, a_good = _e(roles=("candidate",), ratio=1.5, shapes=("A",)), _e(roles=("candidate",), ratio=0.7, shapes=("A",))
    b_bad = _e(roles=("candidate",), ratio=1.3, shapes=("B",))
    assert LL.check_loops([ok_default, a_bad, a_good], {})[0] == []
    problems, _ = LL.check_loops([ok_default, a_bad, a_good, b_bad], {})
    assert len(problems) == 1 and "candidate configs issue_ratio 1.3" in problems[0]  # layer B's best
    problems, _ = LL.check_loops([_e(ratio=1.1), a_good], {})
    assert len(problems) == 1 and "default config issue_ratio 1.1" in problems[0]
    both = _e(roles=("candidate", "default"), ratio=0.5)  # a default config that is also a candidate
    assert LL.check_loops([both], {})[0] == []
    figs, _ = LL.loop_figures([ok_default, a_bad, a_good, b_bad])
    assert figs["triton fprop [3x3s1] bf16 sm_90"]["issue_ratio"] == {"limit": 1.0, "default": 0.9, "candidate": 1.3}


def test_unjudgeable_entries_fail():
    e = _e()
    e["loop"] = None
    problems, _ = LL.check_loops([e], {})
    assert problems == ["triton fprop [3x3s1] bf16 sm_90 [128x64x64 w8 s3]: no main loop with tensor-core instructions"]
    e["loop"] = {"issue_ratio": None, "wgmma_waits": [], "int_div": 0, "bar_sync": 0}
    assert "MMAs the model does not cover" in LL.check_loops([e], {})[0][0]


def test_one_step_launches_have_no_loop_to_judge():
    """A one-step launch (STEPS > 0, no MMA loop) is no problem and adds no default figure; a layer
    whose candidates include one has a candidate that meets every limit. With STEPS 0, or with a
    loop despite it, an entry is judged as before. The async-copy rule of check_entries spares it."""
    from tools.static_report.limits import check_entries

    def one(roles=("default",), shapes=("A",), flag="1", loop=None):
        e = _e(roles=roles, shapes=shapes)
        e.update(loop=loop, constexprs={"STEPS": flag}, conv=True, async_copies={})
        return e

    key = "triton fprop [3x3s1] bf16 sm_90"
    assert LL.one_step(one()) and LL.one_step(one(flag="2")) and not LL.one_step(one(flag="0"))
    assert not LL.one_step(_e())
    assert not LL.one_step(one(loop=_e()["loop"]))
    assert LL.check_loops([one()], {}) == ([], [])
    figs, _ = LL.loop_figures([one(), _e(ratio=0.9, shapes=("B",))])
    assert figs[key]["issue_ratio"]["default"] == 0.9  # the one-step default adds nothing
    assert LL.loop_figures([one()])[0][key]["issue_ratio"]["default"] is None
    bad_cand = _e(roles=("candidate",), ratio=1.5, shapes=("A",))
    assert LL.check_loops([_e(ratio=0.9), bad_cand, one(roles=("candidate",))], {})[0] == []
    assert len(LL.check_loops([_e(ratio=0.9), bad_cand], {})[0]) == 1
    assert "no main loop" in LL.check_loops([one(flag="0")], {})[0][0]
    assert "1.5" in LL.check_loops([one(loop=dict(_e()["loop"], issue_ratio=1.5))], {})[0][0]
    plain = dict(one(), mma=4, stack_bytes=0, shared_bytes=0)
    assert check_entries([plain]) == []
    assert "no async global" in check_entries([dict(plain, constexprs={"STEPS": "0"})])[0]


def test_ratchet():
    """Today's offenders go into the baseline; --check passes on them, fails when one gets worse than
    the tolerance allows or a new one appears, notes improvements; the update shrinks the baseline."""
    today = [_e(ratio=3.9, div=1), _e(kernel="wgrad", ratio=4.7, waits=(0,)), _e(kernel="dgrad", ratio=0.6),
             _e(arch="sm_80", ratio=1.9)]
    base, changes = LL.update_baseline(today, {"offenders": {"triton stale [x] bf16 sm_90": {}}})
    assert base["tolerance"] == LL.TOLERANCE and set(base["offenders"]) == {
        "triton fprop [3x3s1] bf16 sm_90", "triton wgrad [3x3s1] bf16 sm_90", "triton fprop [3x3s1] bf16 sm_80",
        "triton stale [x] bf16 sm_90"}  # a variant this run did not cover keeps its line
    assert "+ triton fprop [3x3s1] bf16 sm_90" in changes
    assert base["offenders"]["triton fprop [3x3s1] bf16 sm_90"] == {"issue_ratio": {"default": 3.9},
                                                                    "int_div": {"default": 1}}
    assert LL.check_loops(today, base) == ([], [])
    slightly = [_e(ratio=3.9 * 1.015, div=1)] + today[1:]
    assert LL.check_loops(slightly, base)[0] == []  # within the 2% tolerance
    worse = [_e(ratio=3.9 * 1.05, div=1)] + today[1:]
    problems, _ = LL.check_loops(worse, base)
    assert len(problems) == 1 and "worse than the baseline's 3.9" in problems[0]
    more_div = [_e(ratio=3.9, div=2)] + today[1:]
    assert "int_div 2" in LL.check_loops(more_div, base)[0][0]
    new_rule = [_e(ratio=3.9, div=1, bars=4)] + today[1:]
    assert "bar_sync 4" in LL.check_loops(new_rule, base)[0][0] and "not in the baseline" in LL.check_loops(new_rule, base)[0][0]
    better = [_e(ratio=2.0, div=0)] + today[1:]
    problems, notes = LL.check_loops(better, base)
    assert problems == [] and len(notes) == 2
    assert any("int_div now meets its limit" in n for n in notes) and any("issue_ratio 2" in n for n in notes)
    shrunk, changes = LL.update_baseline(better, base)
    assert shrunk["offenders"]["triton fprop [3x3s1] bf16 sm_90"] == {"issue_ratio": {"default": 2.0}}
    assert changes == ["~ triton fprop [3x3s1] bf16 sm_90"]
    fixed = [_e(ratio=0.9)] + today[1:]
    assert "triton fprop [3x3s1] bf16 sm_90" not in LL.update_baseline(fixed, base)[0]["offenders"]


def test_baseline_file_round_trip(tmp_path):
    base, _ = LL.update_baseline([_e(ratio=3.9, div=1), _e(kernel="wgrad", ratio=4.7)], {})
    path = tmp_path / "b.json"
    LL.write_baseline(path, base)
    assert LL.load_baseline(path) == base
    assert len(path.read_text().splitlines()) == 2 + 1 + 2 + 2  # braces, tolerance, offenders open/close, 2 lines
    assert LL.load_baseline(tmp_path / "missing.json") == {"tolerance": LL.TOLERANCE, "offenders": {}}


def test_convs_of_one_block_are_layers_of_their_own():
    """PreActResNet-164's layer1.0 launches the 1×1 wgrad variant for two convs (16→16 and 16→64): the
    jobs name the conv beside the block, so each conv's candidates are judged on their own (one
    conv's good candidate must not stand in for the other's), and the BatchNorm kernels keep the block.
    The staged-halo wgrad of its 3×3 is recorded both split and with one program (dW stored directly,
    as a GPU runs it for a small batch)."""
    import torch

    from fused_preact.bench.shapes import enumerate_units
    from tools.static_report.jobs import chain_jobs

    units = [u for u in enumerate_units("preact_resnet164", 128) if any("layer1.0/" in n for n in u.names)]
    block = "preact_resnet164/layer1.0 [bottleneck 16→64 /1 @32²]"
    jobs = [j for j in chain_jobs(units, [torch.bfloat16]) if j.shape.startswith(block)]
    wgrad_1x1 = {j.shape for j in jobs if j.kernel == "wgrad" and j.variant == "1x1s1 sum1 HAS_GAMMA"}
    assert wgrad_1x1 == {f"{block} 1x1/1 16→16 @32x32", f"{block} 1x1/1 16→64 @32x32"}
    assert {j.shape for j in jobs if j.kernel == "wgrad" and j.variant.startswith("3x3")} == {
        f"{block} 3x3/1 16→16 @32x32"}
    assert {j.shape for j in jobs if j.kernel in ("stats", "finalize")} == {block}
    # the staged-halo wgrad is compiled split (the meta plan's programs) and storing dW directly
    assert {j.kwargs["SPLIT_K"] for j in jobs if j.kernel == "wgrad" and "RPI" in j.kwargs} == {True, False}
    # the figures follow: the 16→64 conv's candidate (0.7) does not hide the 16→16 conv's best (1.3)
    a = _e(roles=("candidate",), ratio=0.7, shapes=(f"{block} 1x1/1 16→64 @32x32",))
    b = _e(roles=("candidate",), ratio=1.3, shapes=(f"{block} 1x1/1 16→16 @32x32",))
    assert LL.loop_figures([_e(ratio=0.9), a, b])[0]["triton fprop [3x3s1] bf16 sm_90"]["issue_ratio"]["candidate"] == 1.3


def test_summary_reports_each_model_and_release_on_its_own_layers():
    from tools.static_report.report import summary_table

    def obj(version, ratio_b, stack=0):
        es = [_e(ratio=0.8, shapes=("a/layer1.0",)), _e(kernel="wgrad", ratio=ratio_b, shapes=("b/layer1.0",)),
              _e(kernel="dgrad", arch="sm_80", ratio=0.5, shapes=("a/layer2.0", "b/layer2.0"))]
        es[1]["stack_bytes"] = stack
        return {"triton": version, "entries": es}

    md = summary_table([obj("3.6.0", 1.5, stack=8), obj("3.9.0", 0.9)], ["a", "b"])
    rows = [ln for ln in md.splitlines() if ln.startswith("| 3.")]
    # newest release first; model a sees only its own layers (no wgrad), b its wgrad over the limit under 3.6
    assert rows[0].startswith("| 3.9.0 | 2 | 0 | 0.80 | – | – | – | 0.50 | – | 0 |")
    assert rows[1].startswith("| 3.6.0 | 2 | 0 | 0.80 |")
    assert rows[2] == "| 3.9.0 | 2 | 0 | – | – | 0.90 | – | 0.50 | – | 0 |"
    assert rows[3] == "| 3.6.0 | 2 | 1 | – | – | 1.50 | – | 0.50 | – | 1 |"
