"""The Triton kernel of ``--ts-fused-master-step`` (:mod:`torchscale_fairseq.optim.master_adamw`, whose
docstring states the update): one program per ``BLOCK`` elements of one parameter, the parameter's
addresses read from a table (numel, then 16-bit parameter, 16-bit gradient or 0, fp32 master, first
and second moment, step count before this update). ``ALIGNED``: the caller checked that every address is a
multiple of 16 bytes and every numel of 16, which lets Triton load and store vectors. On the CPU it runs in
Triton's interpreter."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def _master_adamw(table, chunk_param, chunk_start, scale_ptr, found_inf_ptr, log_betas_ptr,
                  lr, beta1, beta2, eps, weight_decay, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    if tl.load(found_inf_ptr) != 0:
        return
    row = table + tl.load(chunk_param + tl.program_id(0)).to(tl.int64) * 7
    numel = tl.load(row)
    p16_ptr = tl.load(row + 1).to(tl.pointer_type(tl.bfloat16))
    g16_addr = tl.load(row + 2)
    g16_ptr = g16_addr.to(tl.pointer_type(tl.bfloat16))
    p_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
    t = tl.load(tl.load(row + 6).to(tl.pointer_type(tl.float32))).to(tl.float64) + 1.0  # this update's step
    step_size = (lr / (1.0 - tl.exp(t * tl.load(log_betas_ptr)))).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(1.0 - tl.exp(t * tl.load(log_betas_ptr + 1))).to(tl.float32)
    offsets = tl.load(chunk_start + tl.program_id(0)) + tl.arange(0, BLOCK)
    if ALIGNED:  # every address a multiple of 16 bytes and every numel of 16: vector loads and stores
        offsets = tl.max_contiguous(tl.multiple_of(offsets, BLOCK), BLOCK)
        numel = tl.multiple_of(numel, 16)
        p16_ptr = tl.multiple_of(p16_ptr, 16)
        g16_ptr = tl.multiple_of(g16_ptr, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    mask = offsets < numel
    g = tl.load(g16_ptr + offsets, mask=mask & (offsets * 0 + g16_addr != 0), other=0.0).to(tl.float32)
    g = tl.div_rn(g, tl.load(scale_ptr))
    p = tl.load(p_ptr + offsets, mask=mask)
    m = tl.load(m_ptr + offsets, mask=mask)
    v = tl.load(v_ptr + offsets, mask=mask)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denominator = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - tl.div_rn(step_size * m, denominator)
    tl.store(p_ptr + offsets, p, mask=mask)
    tl.store(m_ptr + offsets, m, mask=mask)
    tl.store(v_ptr + offsets, v, mask=mask)
    # bfloat16(p), rounded to nearest even as torch rounds it (NaN stays NaN), in integer ops that Triton's
    # interpreter runs as the GPU does (its float cast truncates)
    bits = p.to(tl.uint32, bitcast=True)
    high = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    high = tl.where(p != p, 0x7FC0, high).to(tl.uint16)
    tl.store(p16_ptr + offsets, high.to(tl.bfloat16, bitcast=True), mask=mask)


KERNELS = {"cuda": triton.jit(_master_adamw), "cpu": InterpretedFunction(_master_adamw)}
