"""Python model of the grouped quantizers' store schemes (csrc/include/megatron_tma/kernels/quantize_grouped_128x1.cuh), used
to check their byte bookkeeping before running them: every token byte of a qt row written exactly once and
nothing outside [0, M), for runs of 1-8 blocks over hundreds of group layouts. This models the whole
128-byte line scheme (store_token_lines: parked line heads), lane by lane: lane j of a row owns chunk j of
line A (completed with the parked bytes) and of line B (parked for the next block of the run).

    python lab/models/quant_store_model.py
"""
import random
def window(tile, k, sh):   # tile bytes [16k + sh - 16, 16k + sh) i.e. bytes [sh,sh+16) of chunk(k-1)|chunk(k)
    def ch(i): return tile[16*i:16*i+16] if 0 <= i < 8 else ['Z']*16
    return (ch(k-1)+ch(k))[sh:sh+16]
def own_chunk(tile, a, cabs):  # tile bytes [16*cabs - a, +16)
    A_hi, a_lo = a >> 4, a & 15
    k = cabs - A_hi
    if a_lo == 0:
        return tile[16*k:16*k+16] if 0 <= k < 8 else ['Z']*16
    return window(tile, k, 16 - a_lo)
def merge(keep, rest, n): return keep[:n] + rest[n:]
def store_range(dst, base, vals16, j, lo, hi):
    clo = min(max(lo - 16*j, 0), 16); chi = min(max(hi - 16*j, 0), 16)
    if chi <= clo: return
    for i in range(clo, chi): dst[base + 16*j + i] = vals16[i]
def store_row(tile, dst, row0, rows, carry_lo, carry, keep_tail):
    a = row0 & 127; L0 = row0 - a; end = a + rows
    lo = carry_lo if carry_lo >= 0 else a
    hiA = min(128, end)
    lineA = []
    for j in range(8):
        n = min(max(a - 16*j, 0), 16)
        lineA.append(merge(carry[j], own_chunk(tile, a, j), n))
    new_lo = -1
    if end >= 128:
        for j in range(8): store_range(dst, L0, lineA[j], j, lo, 128)
        if end > 128:
            lineB = [own_chunk(tile, a, 8 + j) for j in range(8)]
            if keep_tail:
                for j in range(8): carry[j] = lineB[j]
                new_lo = 0
            else:
                for j in range(8): store_range(dst, L0 + 128, lineB[j], j, 0, end - 128)
    else:
        if keep_tail:
            for j in range(8): carry[j] = lineA[j]
            new_lo = lo
        else:
            for j in range(8): store_range(dst, L0, lineA[j], j, lo, hiA)
    return new_lo
def run(sizes, R):
    m = sum(sizes); pitch = -(-m // 16) * 16; G = len(sizes); mb = m // 128 + G
    off = [0]
    for x in sizes: off.append(off[-1] + x)
    blocks = []
    for g in range(G):
        r = off[g]
        while r < off[g+1]:
            blocks.append((r, min(128, off[g+1] - r))); r += 128
    blocks += [(0, 0)] * (mb - len(blocks))
    dst = [None] * (pitch + 256)
    units = list(range(-(-mb // R))); random.shuffle(units)
    for u in units:
        b0 = u * R; L = min(R, mb - b0); carry_lo = -1; carry = [['G']*16 for _ in range(8)]
        for j in range(L):
            row0, rows = blocks[b0 + j]
            nxt = blocks[b0 + j + 1][1] if j + 1 < L else 0
            if rows > 0:
                tile = [('T', row0 + i) if i < rows else 'X' for i in range(128)]
                carry_lo = store_row(tile, dst, row0, rows, carry_lo, carry, j + 1 < L and nxt > 0)
    for i in range(m): assert dst[i] == ('T', i), (sizes, R, i, dst[i])
    for i in range(m, len(dst)): assert dst[i] is None, (sizes, R, i, dst[i])
random.seed(2)
cases = [[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,143,129,130,131,255,257,0,1], [0,1,127,128,129,0,300,7], [5], [16,16,3], [1]*40, [300,0,0,1,1,1,200], [128]*5, [16]*20, [1000], [127]*9]
for _ in range(500):
    G = random.randint(1, 30)
    cases.append([random.choice([0,1,2,3,15,16,17,100,127,128,129,250,256,257,400]) if random.random() < 0.6 else random.randint(0, 700) for _ in range(G)])
for sz in cases:
    if sum(sz) == 0: continue
    for R in (1, 2, 3, 4, 8):
        run(sz, R)
print("whole-line scheme: ok on", len(cases), "layouts x runs 1,2,3,4,8")
