"""tools/sass_loops.py's reading of a cuobjdump -sass listing, on the CPU: instructions with their
addresses, opcodes without predicates and modifiers, and each backward branch's loop (forward branches,
warp-divergence branches and a kernel's final self-branch are not loops of interest)."""
from tests.fixtures import load_tool

LISTING = """
        Function : strata_example
        /*0000*/                   LDC R1, c[0x0][0x28] ;                                /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                                    /* 0x0000000000007919 */
        /*0020*/              @!P0 IMAD.WIDE.U32 R2, R0, 0x4, R4 ;                       /* 0x0000000400028825 */
        /*0030*/                   LDG.E.128 R8, desc[UR6][R2.64] ;                      /* 0x0000000602087981 */
        /*0040*/                   HMMA.16816.F32 R12, R8, R10, R12 ;                    /* 0x0000000a080c723c */
        /*0050*/               @P1 BRA 0x80 ;                                            /* 0x0000000000081947 */
        /*0060*/                   FMUL R12, R12, R13 ;                                  /* 0x0000000d0c0c7220 */
        /*0070*/                   BRA.DIV UR4, 0x30 ;                                   /* 0x0000000604007947 */
        /*0080*/              @!P0 BRA 0x30 ;                                            /* 0xfffffffc00a88947 */
        /*0090*/                   FADD R1, R1, R2 ;                                     /* 0x0000000201017221 */
        /*00a0*/               @P0 BRA P1, 0x20 ;                                        /* 0xfffffffc00a88947 */
        /*00b0*/                   EXIT ;                                                /* 0x000000000000794d */
        /*00c0*/                   BRA 0xc0;                                             /* 0xfffffffc00fc7947 */
"""


def test_parse_and_opcodes():
    tool = load_tool("sass_loops")
    ins = tool.parse_sass(LISTING)
    assert [a for a, _ in ins][:3] == [0x0, 0x10, 0x20] and len(ins) == 13
    assert [tool.opcode(t) for _, t in ins[:6]] == ["LDC", "S2R", "IMAD", "LDG", "HMMA", "BRA"]


def test_backward_branches_are_the_loops_innermost_first():
    tool = load_tool("sass_loops")
    found = tool.loops(tool.parse_sass(LISTING))
    assert [(lp.start, lp.end, lp.count) for lp in found] == [(0x30, 0x80, 6), (0x20, 0xa0, 9)]
    inner = found[0].ops
    assert inner["HMMA"] == 1 and inner["LDG"] == 1 and inner["BRA"] == 3 and inner["FMUL"] == 1
    assert tool.loops(tool.parse_sass(LISTING), smallest=7) == found[1:]


def test_ptxas_statistics_of_one_kernel():
    tool = load_tool("sass_loops")
    log = """ptxas info    : Compiling entry function 'a' for 'sm_90'
ptxas info    : Function properties for a
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 41536 bytes smem
ptxas info    : Compiling entry function 'b' for 'sm_90'
ptxas info    : Function properties for b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 20768 bytes smem"""
    assert tool.ptxas_stats(log, "b") == ("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads | "
                                          "Used 128 registers, used 1 barriers, 20768 bytes smem")
    assert "4 bytes spill stores" in tool.ptxas_stats(log, "a")
    assert tool.ptxas_stats(log, "c") == "(ptxas gave no statistics)"
