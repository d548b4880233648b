"""pounce.to_mxfp8 and pounce.from_mxfp8 on a Hopper GPU: from_mxfp8 bit for bit an fp32 reference over
every pair of E4M3 code and scale code (0xFF: NaN), to_mxfp8's scales by the MX rule and its round trip
within E4M3's rounding, leading dimensions kept, opcheck, torch.compile, and bad inputs named."""

import pytest
from support import needs_hopper, pounce, torch

pytestmark = needs_hopper


def reference_from_mxfp8(data, scales):
    """data * 2^(scales - 127) in fp32 (the scale built from its bits: exact, subnormal 2^-127 included),
    rounded to bf16; NaN where the scale is 0xFF."""
    codes = scales.to(torch.int32)
    bits = torch.where(codes == 0, torch.full_like(codes, 0x00400000), codes << 23)
    scale = bits.view(torch.float32).repeat_interleave(pounce.mxfp8.MX_BLOCK, dim=-1)
    scale = torch.where(codes.repeat_interleave(pounce.mxfp8.MX_BLOCK, dim=-1) == 255, float("nan"), scale)
    return (data.view(torch.float8_e4m3fn).float() * scale).to(torch.bfloat16)


def same_bits(a, b):
    """Equal bf16 bits, or both NaN."""
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())).all())


def test_from_mxfp8_is_exact_on_every_code():
    # Row r: every E4M3 code, every block under scale code r: each (code, scale) pair once.
    data = torch.arange(256, device="cuda").to(torch.uint8).repeat(256, 1)
    scales = torch.arange(256, device="cuda").to(torch.uint8).view(256, 1).repeat(1, 8)
    got = pounce.from_mxfp8(data, scales)
    assert got.dtype == torch.bfloat16 and got.shape == (256, 256)
    assert same_bits(got, reference_from_mxfp8(data, scales))
    assert same_bits(pounce.from_mxfp8(data.view(torch.float8_e4m3fn), scales), got)  # either dtype of data


def test_to_mxfp8_follows_the_mx_rule_and_round_trips():
    # Blocks of 32 with magnitudes 2^-20 to 2^20 apart, under two leading dimensions.
    binades = torch.exp2(torch.randint(-20, 21, (3, 40, 8, 1), device="cuda").float())
    x = (torch.randn(3, 40, 8, 32, device="cuda") * binades).flatten(-2).to(torch.bfloat16)
    data, scales = pounce.to_mxfp8(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape
    assert scales.dtype == torch.uint8 and scales.shape == (3, 40, 8)
    # The spec's rule: e = floor(log2(amax)) - 8 (E4M3's largest binade is 2^8); frexp gives floor(log2)
    # + 1 exactly. (No block here is all zeros or near the clamp at 2^-127 or 2^127.)
    amax = x.float().abs().view(3, 40, 8, 32).amax(-1)
    want = torch.frexp(amax).exponent.to(torch.int32) - 1 - 8 + 127
    assert torch.equal(scales.to(torch.int32), want)
    back = pounce.from_mxfp8(data, scales)
    error = (back.float() - x.float()).abs()
    # E4M3 keeps 3 mantissa bits: within half a step (2^-4 relative) of each element, or of the block's
    # subnormal step, and the top binade may saturate at 448 * 2^e (at most one part in 8 of the amax).
    step = torch.exp2(want.float() - 127 - 9).repeat_interleave(32, dim=-1)
    assert bool((error <= torch.maximum(x.float().abs() / 8, step)).all())


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 8),
                    reason="opcheck compares float8 outputs from PyTorch 2.8 on")
def test_opcheck_and_compile():
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pounce.to_mxfp8.default, (x,))
    data, scales = pounce.to_mxfp8(x)
    # opcheck's mutation check multiplies its inputs, which float8 tensors cannot: data as its uint8 bits.
    torch.library.opcheck(torch.ops.pounce.from_mxfp8.default, (data.view(torch.uint8), scales))
    compiled = torch.compile(lambda t: pounce.from_mxfp8(*pounce.to_mxfp8(t)), fullgraph=True)
    assert same_bits(compiled(x), pounce.from_mxfp8(data, scales))


@pytest.mark.parametrize("make, needle", [
    (lambda: pounce.to_mxfp8(torch.zeros(4, 48, device="cuda", dtype=torch.bfloat16)), "multiple of 32"),
    (lambda: pounce.to_mxfp8(torch.zeros(4, 64, device="cuda")), "x has dtype torch.float32"),
    (lambda: pounce.to_mxfp8(torch.zeros(64, 4, device="cuda", dtype=torch.bfloat16).T), "x is not contiguous"),
    (lambda: pounce.to_mxfp8(torch.zeros(4, 64, dtype=torch.bfloat16)), "x is on cpu"),
    (lambda: pounce.from_mxfp8(torch.zeros(4, 64, device="cuda", dtype=torch.uint8),
                               torch.zeros(4, 3, device="cuda", dtype=torch.uint8)), "scales has shape (4, 3)"),
    (lambda: pounce.from_mxfp8(torch.zeros(4, 64, device="cuda", dtype=torch.int8),
                               torch.zeros(4, 2, device="cuda", dtype=torch.uint8)), "data has dtype torch.int8"),
])
def test_bad_inputs_are_named(make, needle):
    with pytest.raises(pounce.Error, match=needle.replace("(", r"\(").replace(")", r"\)")):
        make()
