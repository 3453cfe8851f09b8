"""AMX GEMM: where the time goes, and which cache blocks of the AMX kernel are fastest (one thread).

Issue 17 asks for the AMX GEMM at 85 % of the measured AMX peak; tvmamp's kernel ran at 17-28 %
of the ``tdpbf16ps`` loop of ``bench_cpu_bf16.py``, and torch (oneDNN) at 13-23 %. That loop
keeps both operands in tile registers. This bench measures two things on an AMX host:

1. **Ceilings with loads.** The 2 x 2 tile step of ``schedules/x86/amx_intrin.py`` (two A and
   two B tile loads, four ``tdpbf16ps``) in a C loop, its A and B tiles walked through buffers
   of given sizes: both in L1, one in L1 and one in L2, both in L2, both beyond L2. It says
   how fast the kernel's inner loop can run wherever its operands sit.
2. **Cache blocks.** Each GEMM built with the kernel's plan forced to every
   ``(n_block, k_block)`` of a grid (:func:`tvmamp.schedules.cpu.bf16_amx.make_plan`; the
   automatic plan first), checked against float64, and timed interleaved with ``torch.mm``.
   Libraries are built in parallel worker processes, then timed one at a time.
3. **Loop orders** (``--loop-orders``, alone: no TVM). Whole GEMMs in C built from the same
   2 x 2 tile step on the product's packed layouts, in several loop orders: the product's
   (512-column slices, 32-row blocks, panel pairs, all of K), BRGEMM-style column and K blocks
   (C reloaded per K block), B strip resident, A row block resident. Each checked against a
   double reference and timed: what a TVM-emitted kernel could reach, and in which order.
   ``--emulate`` runs them on a scalar emulation of the tile registers (any x86 host) for
   correctness only.

Run: TVM_NUM_THREADS=1 python bench/bench_amx_blocking.py [--shapes 1024x1024x1024,...]
     [--k-blocks 128,256,512,1024,4096] [--n-blocks auto,128,256,512] [--jobs 8]
     [--mcpu sapphirerapids --build-only]   (compile only: checks the sweep builds anywhere)
     python bench/bench_amx_blocking.py --loop-orders [--loop-shapes 1024x1024x1024,...]
     python bench/bench_amx_blocking.py --emulate [--loop-shapes 96x288x160,...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import subprocess
import tempfile
import time

# What both C programs share: headers, a clock, and (AMX builds) Linux's permission to use the
# tile registers and the palette-1 configuration of all eight as 16 rows of 64 bytes.
_C_PRELUDE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
static double now(void){
  struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#ifndef EMULATE
typedef struct {
  unsigned char palette, start, res[14]; unsigned short colsb[16]; unsigned char rows[16];
} cfg_t;
/* 0 where Linux refuses AMX to this process, else 1 with the eight tiles configured */
static int amx_start(void){
  if(syscall(SYS_arch_prctl, 0x1023, 18)) return 0;
  cfg_t c; memset(&c,0,sizeof c); c.palette=1;
  for(int i=0;i<8;i++){c.colsb[i]=64;c.rows[i]=16;}
  _tile_loadconfig(&c); return 1;}
#endif
"""
_LOADS_C = (
    _C_PRELUDE
    + r"""
/* GFLOP/s of n 2x2 tile steps, A and B tiles read in turn from buffers of na and nb bytes */
static double steps(long n, const char *a, long na, const char *b, long nb){
  long ia=0, ib=0; double t=now();
  for(long i=0;i<n;i++){
    _tile_loadd(4,a+ia,64); _tile_loadd(5,a+ia+1024,64);
    _tile_loadd(6,b+ib,64); _tile_loadd(7,b+ib+1024,64);
    _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);
    ia+=2048; if(ia>=na) ia=0; ib+=2048; if(ib>=nb) ib=0;}
  return n*4.0*16*16*32*2/(now()-t)/1e9;}
int main(int argc, char **argv){
  if(!amx_start()) { puts("no AMX"); return 0; }
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  for(int arg=1; arg+1<argc; arg+=2){
    long na=atol(argv[arg]), nb=atol(argv[arg+1]);
    char *a=aligned_alloc(4096,na), *b=aligned_alloc(4096,nb);
    for(long i=0;i<na;i++) a[i]=(char)(i*7+1); for(long i=0;i<nb;i++) b[i]=(char)(i*5+3);
    double best=0; steps(20000,a,na,b,nb);
    for(int r=0;r<5;r++){ double g=steps(400000,a,na,b,nb); if(g>best) best=g; }
    printf("%ld %ld %.1f\n", na, nb, best); free(a); free(b);}
  _tile_release(); return 0;}
"""
)
# (label, A bytes, B bytes): L1 is 48 KiB and L2 2 MiB a core on Sapphire/Emerald Rapids
_PLACEMENTS = (
    ("the same two A and two B tiles every step", 2 << 10, 2 << 10),
    ("A and B in L1 (16 KiB each)", 16 << 10, 16 << 10),
    ("A in L1 (16 KiB), B in L2 (512 KiB)", 16 << 10, 512 << 10),
    ("A in L1 (32 KiB), B in L2 (512 KiB)", 32 << 10, 512 << 10),
    ("A and B in L2 (64 KiB each)", 64 << 10, 64 << 10),
    ("A and B in L2 (512 KiB each)", 512 << 10, 512 << 10),
    ("A and B beyond L2 (8 MiB each)", 8 << 20, 8 << 20),
)


def _run_c(source: str, flags: list[str], args: list[str]) -> str | None:
    """Compile ``source`` with gcc and ``flags``, run it with ``args``; its standard output, or
    None where it found no AMX."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "bench.c"), os.path.join(tmp, "bench")
        with open(src, "w", encoding="utf-8") as f:
            f.write(source)
        subprocess.run(["gcc", *flags, src, "-o", exe, "-lm"], check=True)
        out = subprocess.run([exe, *args], check=True, capture_output=True, text=True).stdout
    return None if out.startswith("no AMX") else out


def load_ceilings() -> list[tuple[str, float]] | None:
    """GFLOP/s of the kernel's 2 x 2 tile step by operand placement; None without AMX."""
    sizes = [str(v) for _, na, nb in _PLACEMENTS for v in (na, nb)]
    out = _run_c(_LOADS_C, ["-O2", "-mamx-tile", "-mamx-bf16"], sizes)
    if out is None:
        return None
    rates = [float(line.split()[2]) for line in out.strip().splitlines()]
    return [(label, rate) for (label, _, _), rate in zip(_PLACEMENTS, rates)]


# A whole one-thread bf16 GEMM built from the 2 x 2 tile step, in several loop orders, on the
# product's packed layouts (A [M/16][K/32][16][32], B [N/16][K/2][16][2], C fp32 M x N). The
# tile API has two backends chosen at compile time: the AMX instructions, and with -DEMULATE
# eight 1 KiB tile registers in memory with the tdpbf16ps semantics (for hosts without AMX).
# The kernels use literal tile numbers (0-3: the C block, 4-5: A, 6-7: B) in both.
_LOOP_ORDERS_C = (
    _C_PRELUDE
    + r"""
typedef uint16_t bf16;
static float bf2f(bf16 h){ uint32_t u=(uint32_t)h<<16; float f; memcpy(&f,&u,4); return f; }
#ifdef EMULATE
static union { unsigned char b[16][64]; float f[16][16]; bf16 h[16][32]; } tmm[8];
static void t_zero(int t){ memset(&tmm[t],0,sizeof tmm[t]); }
static void t_load(int t, const char *p, long ld){
  for(int r=0;r<16;r++) memcpy(tmm[t].b[r],p+r*ld,64);}
static void t_store(int t, char *p, long ld){
  for(int r=0;r<16;r++) memcpy(p+r*ld,tmm[t].b[r],64);}
/* C[m][n] += sum_p A[m][2p] B[p][2n] + A[m][2p+1] B[p][2n+1]: rows of B are k pairs */
static void t_dp(int c, int a, int b){
  for(int m=0;m<16;m++) for(int n=0;n<16;n++){
    float acc=tmm[c].f[m][n];
    for(int p=0;p<16;p++){
      acc+=bf2f(tmm[a].h[m][2*p])*bf2f(tmm[b].h[p][2*n]);
      acc+=bf2f(tmm[a].h[m][2*p+1])*bf2f(tmm[b].h[p][2*n+1]);}
    tmm[c].f[m][n]=acc;}}
#define TZERO(t) t_zero(t)
#define TLOAD(t,p,ld) t_load(t,(const char*)(p),ld)
#define TSTORE(t,p,ld) t_store(t,(char*)(p),ld)
#define TDP(c,a,b) t_dp(c,a,b)
#else
#define TZERO(t) _tile_zero(t)
#define TLOAD(t,p,ld) _tile_loadd(t,p,ld)
#define TSTORE(t,p,ld) _tile_stored(t,p,ld)
#define TDP(c,a,b) _tile_dpbf16ps(c,a,b)
#endif
#define INL static inline __attribute__((always_inline))
/* gcc's tileloadd asm reads memory it does not name: each kernel starts with the packing's and
   the NaN fill's stores done */
#define BARRIER() __asm__ volatile("" ::: "memory")
/* steps k steps of the 2x2 tile step, in the order of schedules/x86/amx_intrin.py: A tiles at
   a and a+lda, B tiles at b and b+ldb, each 1 KiB further on per k step */
INL void kloop(const char *a, long lda, const char *b, long ldb, long steps){
  for(long k=0;k<steps;k++, a+=1024, b+=1024){
    TLOAD(4,a,64); TLOAD(6,b,64); TDP(0,4,6);
    TLOAD(7,b+ldb,64); TDP(1,4,7);
    TLOAD(5,a+lda,64); TDP(2,5,6); TDP(3,5,7);}}
INL void czero(void){ TZERO(0); TZERO(1); TZERO(2); TZERO(3); }
INL void cload(const float *c, long n){
  TLOAD(0,c,n*4); TLOAD(1,c+16,n*4); TLOAD(2,c+16*n,n*4); TLOAD(3,c+16*n+16,n*4);}
INL void cstore(float *c, long n){
  TSTORE(0,c,n*4); TSTORE(1,c+16,n*4); TSTORE(2,c+16*n,n*4); TSTORE(3,c+16*n+16,n*4);}
typedef struct { long M, K, N; const char *a, *b; float *c; } gemm_t;
/* the 32-row block ib and 32-column panel pair jp at k step k0 (bytes); lda = ldb = 32 K */
#define A_AT(g,ib,k0) ((g)->a+(ib)*64*(g)->K+(k0)*1024)
#define B_AT(g,jp,k0) ((g)->b+(jp)*64*(g)->K+(k0)*1024)
#define C_AT(g,ib,jp) ((g)->c+(ib)*32*(g)->N+(jp)*32)
static long lmin(long x, long y){ return x<y?x:y; }
/* the product's order: 512-column slices; 32-row blocks; panel pairs; all of K */
static void k_current(const gemm_t *g, long slice, long unused){
  (void)unused; BARRIER(); long ks=g->K/32, ld=32*g->K;
  for(long n0=0;n0<g->N;n0+=slice) for(long ib=0;ib<g->M/32;ib++)
    for(long jp=n0/32;jp<lmin(n0+slice,g->N)/32;jp++){
      czero(); kloop(A_AT(g,ib,0),ld,B_AT(g,jp,0),ld,ks); cstore(C_AT(g,ib,jp),g->N);}}
/* column blocks of nb; K blocks of kb; 32-row blocks; panel pairs: C reloaded per K block */
static void k_brgemm(const gemm_t *g, long nb, long kb){
  BARRIER(); long ld=32*g->K;
  for(long n0=0;n0<g->N;n0+=nb) for(long k0=0;k0<g->K;k0+=kb){
    long ks=(lmin(k0+kb,g->K)-k0)/32;
    for(long ib=0;ib<g->M/32;ib++)
      for(long jp=n0/32;jp<lmin(n0+nb,g->N)/32;jp++){
        float *c=C_AT(g,ib,jp);
        if(k0==0) czero(); else cload(c,g->N);
        kloop(A_AT(g,ib,k0/32),ld,B_AT(g,jp,k0/32),ld,ks); cstore(c,g->N);}}}
/* panel pairs outermost: one B strip (32 columns x K) stays hot while all of A streams */
static void k_b_resident(const gemm_t *g, long unused0, long unused1){
  (void)unused0; (void)unused1; BARRIER(); long ks=g->K/32, ld=32*g->K;
  for(long jp=0;jp<g->N/32;jp++) for(long ib=0;ib<g->M/32;ib++){
    czero(); kloop(A_AT(g,ib,0),ld,B_AT(g,jp,0),ld,ks); cstore(C_AT(g,ib,jp),g->N);}}
/* row blocks of mb (mb x K of A hot); panel pairs; 32-row blocks of the row block */
static void k_a_resident(const gemm_t *g, long mb, long unused){
  (void)unused; BARRIER(); long ks=g->K/32, ld=32*g->K;
  for(long m0=0;m0<g->M;m0+=mb) for(long jp=0;jp<g->N/32;jp++)
    for(long ib=m0/32;ib<lmin(m0+mb,g->M)/32;ib++){
      czero(); kloop(A_AT(g,ib,0),ld,B_AT(g,jp,0),ld,ks); cstore(C_AT(g,ib,jp),g->N);}}
typedef void (*kernel_fn)(const gemm_t *, long, long);
static unsigned long long rng_state=88172645463325252ULL;
static bf16 rand_bf16(void){  /* uniform in [-1, 1), rounded down to bf16 */
  rng_state=rng_state*6364136223846793005ULL+1442695040888963407ULL;
  float v=(float)((rng_state>>40)*(1.0/16777216.0))*2.f-1.f;
  uint32_t u; memcpy(&u,&v,4); return (bf16)(u>>16);}
static void *alloc(size_t n){
  void *p=aligned_alloc(4096,(n+4095)/4096*4096); memset(p,0,n); return p;}
/* checks one kernel against ref (max|c - ref| / max|ref|), then times it: best of rounds
   timed runs of reps calls each, reps making a timed run last min_s */
static void measure(const gemm_t *g, const double *ref, const char *name, kernel_fn f, long p1,
                    long p2, double min_s, int rounds){
  long mn=g->M*g->N; memset(g->c,0xff,mn*4);  /* NaN: an element never written fails */
  double t=now(); f(g,p1,p2); t=now()-t;
  double dmax=0, rmax=0;
  for(long i=0;i<mn;i++){
    double d=fabs((double)g->c[i]-ref[i]); if(isnan(d)) d=INFINITY;
    if(d>dmax) dmax=d;
    if(fabs(ref[i])>rmax) rmax=fabs(ref[i]);}
  long reps=0; double best=t;
  if(rounds>0){
    reps=(long)(min_s/(t>1e-9?t:1e-9))+1;
    for(int r=0;r<rounds;r++){
      double s=now(); for(long i=0;i<reps;i++) f(g,p1,p2); s=(now()-s)/reps;
      if(r==0||s<best) best=s;}}
  printf("%ld %ld %ld %s %ld %ld %.1f %.3e %ld\n", g->M, g->K, g->N, name, p1, p2,
         2.0*g->M*g->N*g->K/best/1e9, rmax>0?dmax/rmax:dmax, reps);
  fflush(stdout);}
/* usage: loop_orders MIN_S ROUNDS M K N [M K N ...] (M, K, N multiples of 32) */
int main(int argc, char **argv){
  if(argc<6||(argc-3)%3){ fputs("usage: loop_orders MIN_S ROUNDS M K N ...\n",stderr); return 2;}
#ifndef EMULATE
  if(!amx_start()) { puts("no AMX"); return 0; }
#endif
  double min_s=atof(argv[1]); int rounds=atoi(argv[2]);
  for(int arg=3; arg+2<argc; arg+=3){
    long M=atol(argv[arg]), K=atol(argv[arg+1]), N=atol(argv[arg+2]);
    if(M<=0||K<=0||N<=0||M%32||K%32||N%32){
      fprintf(stderr,"shape %ldx%ldx%ld: M, K and N must be positive multiples of 32\n",M,K,N);
      return 2;}
    bf16 *a=alloc(M*K*2), *b=alloc(K*N*2), *ap=alloc(M*K*2), *bp=alloc(K*N*2);
    float *af=alloc(M*K*4), *bfl=alloc(K*N*4), *c=alloc(M*N*4);
    double *ref=alloc(M*N*8), *row=alloc(N*8);
    for(long i=0;i<M*K;i++){ a[i]=rand_bf16(); af[i]=bf2f(a[i]); }
    for(long i=0;i<K*N;i++){ b[i]=rand_bf16(); bfl[i]=bf2f(b[i]); }
    /* A tile (i, k) is 1 KiB at (i K/32 + k) KiB; B panel j k-pair p column c element e */
    for(long i=0;i<M/16;i++) for(long k=0;k<K/32;k++) for(long r=0;r<16;r++)
      for(long x=0;x<32;x++) ap[((i*(K/32)+k)*16+r)*32+x]=a[(i*16+r)*K+k*32+x];
    for(long j=0;j<N/16;j++) for(long p=0;p<K/2;p++) for(long x=0;x<16;x++)
      for(long e=0;e<2;e++) bp[((j*(K/2)+p)*16+x)*2+e]=b[(2*p+e)*N+j*16+x];
    for(long i=0;i<M;i++){  /* reference: double accumulation of the same bf16 values */
      for(long j=0;j<N;j++) row[j]=0;
      for(long k=0;k<K;k++){ double x=af[i*K+k]; const float *bk=bfl+k*N;
        for(long j=0;j<N;j++) row[j]+=x*(double)bk[j];}
      for(long j=0;j<N;j++) ref[i*N+j]=row[j];}
    gemm_t g={M,K,N,(const char*)ap,(const char*)bp,c};
    static const long nbs[]={64,128,256,512}, kbs[]={128,256,512,1024}, mbs[]={32,64,128};
    measure(&g,ref,"current",k_current,512,0,min_s,rounds);
    for(int i=0;i<4;i++) for(int j=0;j<4;j++)
      if(nbs[i]<=N && kbs[j]<=K) measure(&g,ref,"brgemm",k_brgemm,nbs[i],kbs[j],min_s,rounds);
    measure(&g,ref,"b_resident",k_b_resident,0,0,min_s,rounds);
    for(int i=0;i<3;i++)
      if(mbs[i]<=M) measure(&g,ref,"a_resident",k_a_resident,mbs[i],0,min_s,rounds);
    free(a); free(b); free(ap); free(bp); free(af); free(bfl); free(c); free(ref); free(row);}
#ifndef EMULATE
  _tile_release();
#endif
  return 0;}
"""
)
# whole GEMMs (m x k x n) for --loop-orders: 288 is 257 rows padded to a multiple of 32
LOOP_ORDER_SHAPES = "1024x1024x1024,288x4096x1024,128x768x3072"
# small shapes for --emulate: partial column, K and row blocks, 17 panel pairs, two n slices
EMULATE_SHAPES = "96x288x160,64x160x544"
# max|C - ref| / max|ref| of fp32 accumulation (the reference: double, same bf16 values)
LOOP_ORDER_TOLERANCE = 1e-5
AMX_FLAGS = ["-O2", "-mamx-tile", "-mamx-bf16", "-mavx512f"]


def loop_order_rates(
    shapes: list[tuple[int, int, int]],
    emulate: bool = False,
    min_seconds: float = 0.05,
    rounds: int = 5,
) -> list[dict] | None:
    """Check and time every loop order of :data:`_LOOP_ORDERS_C` on ``shapes`` (m, k, n).

    Returns one dict per kernel variant (``shape``, ``kernel``, ``p1``, ``p2``, ``gflops``,
    ``rel_err``, ``reps``), or None where the host has no AMX. ``emulate`` builds the tile
    API's scalar emulation (any x86 host; correctness only: its rates mean nothing) and times
    nothing. ``p1``/``p2``: ``current`` slice, 0; ``brgemm`` nb, kb; ``a_resident`` mb, 0.
    """
    # no -mavx512f for the emulation: it runs on any x86-64 host
    flags = ["-O2", "-DEMULATE"] if emulate else AMX_FLAGS
    timing = ["0", "0"] if emulate else [str(min_seconds), str(rounds)]
    out = _run_c(_LOOP_ORDERS_C, flags, [*timing, *(str(d) for shape in shapes for d in shape)])
    if out is None:
        return None
    rows = []
    for line in out.strip().splitlines():
        m, k, n, kernel, p1, p2, gflops, err, reps = line.split()
        rows.append(
            {
                "shape": (int(m), int(k), int(n)),
                "kernel": kernel,
                "p1": int(p1),
                "p2": int(p2),
                "gflops": float(gflops),
                "rel_err": float(err),
                "reps": int(reps),
            }
        )
    return rows


def _variant(row: dict) -> str:
    """The kernel and its blocking, as the table names it."""
    kernel, p1, p2 = row["kernel"], row["p1"], row["p2"]
    if kernel == "current":
        return f"current (n slices of {p1})"
    if kernel == "brgemm":
        return f"brgemm nb {p1}, kb {p2}"
    if kernel == "a_resident":
        return f"a_resident mb {p1}"
    return kernel


def print_loop_orders(rows: list[dict], peak: float | None, timed: bool = True) -> None:
    """Markdown tables: every variant, then the best of each loop order per shape."""
    share = "% of tdpbf16ps peak" if peak else "% of peak (not measured)"
    print(f"| shape m x k x n | kernel / blocking | GFLOP/s | {share} | rel err | reps |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        m, k, n = row["shape"]
        rate = f"{row['gflops']:.0f}" if timed else "(emulated)"
        pct = f"{100 * row['gflops'] / peak:.0f}" if peak and timed else "-"
        print(
            f"| {m}x{k}x{n} | {_variant(row)} | {rate} | {pct} | {row['rel_err']:.1e} "
            f"| {row['reps']} |"
        )
    if not timed:
        return
    print("\n| shape m x k x n | best of each loop order | GFLOP/s |\n|---|---|---|")
    for shape in dict.fromkeys(row["shape"] for row in rows):
        best = {}
        for row in rows:
            if (
                row["shape"] == shape
                and row["gflops"] > best.get(row["kernel"], {"gflops": -1})["gflops"]
            ):
                best[row["kernel"]] = row
        for row in sorted(best.values(), key=lambda r: -r["gflops"]):
            print(f"| {'x'.join(map(str, shape))} | {_variant(row)} | {row['gflops']:.0f} |")


def _parse_shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(d) for d in s.split("x")) for s in text.split(",")]


def run_loop_orders(shapes_text: str | None, emulate: bool) -> None:
    """``--loop-orders`` / ``--emulate``: the whole-GEMM loop orders, nothing of TVM."""
    start = time.perf_counter()
    shapes = _parse_shapes(shapes_text or (EMULATE_SHAPES if emulate else LOOP_ORDER_SHAPES))
    rows = loop_order_rates(shapes, emulate=emulate)
    if rows is None:
        print("loop orders: this host has no AMX (or Linux refused it): nothing to measure")
        return
    peak = None
    if not emulate:
        try:  # the register-only tdpbf16ps loop; bench_cpu_bf16 imports torch and tvmamp
            from bench_cpu_bf16 import measure_peaks

            peak = measure_peaks()["AMX tdpbf16ps"] or None
        except Exception as err:  # the table goes on without the share of the peak
            print(f"tdpbf16ps peak not measured: {type(err).__name__}: {err}")
    if peak:
        print(f"register-only tdpbf16ps loop (bench_cpu_bf16.py): {peak:.1f} GFLOP/s\n")
    print_loop_orders(rows, peak, timed=not emulate)
    bad = [row for row in rows if not row["rel_err"] < LOOP_ORDER_TOLERANCE]
    print(
        f"\nloop orders: {len(rows)} variants, {len(bad)} over rel err {LOOP_ORDER_TOLERANCE:g}, "
        f"took {time.perf_counter() - start:.1f} s"
    )
    if bad:
        raise SystemExit(f"wrong results: {', '.join(_variant(r) for r in bad)}")


def build(job: tuple) -> tuple:
    """Build one GEMM with its AMX plan forced to ``(n_block, k_block)``; export it to ``path``.

    Runs in a worker process. ``n_block=None`` with ``k_block=None`` is the automatic plan.
    Returns the job with the plan the kernel got (``n_block``, ``k_block``, ``k_padded``).
    """
    shape, n_block, k_block, mcpu, path = job
    import tvm
    from bench_cpu_bf16 import _gemm_module  # bench/ is on sys.path, in the workers too

    from tvmamp.pipeline import legalize_passes
    from tvmamp.schedules.cpu import bf16_amx, cpu_schedule_passes
    from tvmamp.targets.llvm_lowering import tir_pipeline

    plans = []
    automatic = bf16_amx.plan_for

    def forced(target, extents, n_default, k_default):
        plan = automatic(
            target, extents, n_block or n_default, k_default if k_block is None else k_block
        )
        if n_block is not None and plan.n_block != n_block:
            plan.n_block = n_block  # even where the automatic choice would pad less
        plans.append(plan)
        return plan

    bf16_amx.plan_for = forced  # a worker builds several jobs: put the original back after
    target = tvm.target.Target({"kind": "llvm", "mcpu": mcpu, "num-cores": 1})
    try:
        with target:
            mod = tvm.transform.Sequential([*legalize_passes(), *cpu_schedule_passes(target)])(
                _gemm_module(*shape, None)
            )
    finally:
        bf16_amx.plan_for = automatic
    exe = tvm.compile(mod, target=target, tir_pipeline=tir_pipeline(target))
    exe.export_library(path)
    plan = plans[0] if plans else None
    return job, None if plan is None else (plan.n_block, plan.k_block, plan.k_padded)


def _parse_blocks(text: str) -> list[int | None]:
    return [None if v == "auto" else int(v) for v in text.split(",")]


def main() -> None:
    """Parse options; measure the load ceilings; build, check and time the block grid.

    ``--loop-orders`` / ``--emulate``: the loop orders of the tile step alone.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes", default="1024x1024x1024,256x1024x1024,257x4096x1024,128x768x3072"
    )
    parser.add_argument("--k-blocks", default="128,256,512,1024,4096")
    parser.add_argument("--n-blocks", default="auto,128,256,512")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--mcpu", help="LLVM CPU to build for (default: this host's)")
    parser.add_argument("--build-only", action="store_true", help="build the grid, time nothing")
    parser.add_argument(
        "--loop-orders",
        action="store_true",
        help="only the whole-GEMM loop orders of the tile step in C (needs AMX; no TVM)",
    )
    parser.add_argument(
        "--emulate",
        action="store_true",
        help="the loop orders on an emulation of the tile registers: correctness, any host",
    )
    parser.add_argument(
        "--loop-shapes",
        help=f"m x k x n, multiples of 32 (default {LOOP_ORDER_SHAPES}; "
        f"with --emulate {EMULATE_SHAPES})",
    )
    args = parser.parse_args()
    if args.loop_orders or args.emulate:
        run_loop_orders(args.loop_shapes, args.emulate)
        return
    os.environ.setdefault("TVM_NUM_THREADS", "1")

    from tvmamp.targets.llvm import host_cpu

    mcpu = args.mcpu or host_cpu()
    if not args.build_only:
        ceilings = load_ceilings()
        if ceilings is None:
            raise SystemExit("this host has no AMX (or Linux refused it): nothing to measure")
        print("| 2 x 2 tile step, operands placed | GFLOP/s |\n|---|---|")
        for label, rate in ceilings:
            print(f"| {label} | {rate:.1f} |")

    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    grid = [(None, None)] + [
        (n, k) for n in _parse_blocks(args.n_blocks) for k in _parse_blocks(args.k_blocks)
    ]
    tmp = tempfile.mkdtemp(prefix="amx_blocks_")
    jobs = [
        (shape, n, k, mcpu, os.path.join(tmp, f"g{i}_{j}.so"))
        for i, shape in enumerate(shapes)
        for j, (n, k) in enumerate(grid)
    ]
    built = {}
    spawn = multiprocessing.get_context("spawn")  # TVM's threads are running: no fork
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
        futures = [pool.submit(build, job) for job in jobs]
        for future in concurrent.futures.as_completed(futures):
            try:
                job, plan = future.result()
            except Exception as err:  # a grid point the schedule refuses: say so, go on
                print(f"build failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                continue
            built[job[4]] = (job, plan)
    print(f"\nbuilt {len(built)} of {len(jobs)} GEMM libraries for mcpu={mcpu}")
    if args.build_only:
        for job, plan in sorted(built.values(), key=lambda v: v[0][4]):
            print(f"{job[0]} forced n {job[1]}, k {job[2]}: plan {plan}")
    if not args.build_only:
        for shape in shapes:
            _time_shape(shape, [v for v in built.values() if v[0][0] == shape], args.repeat)


def _time_shape(shape, entries, repeat: int) -> None:
    """Check every library of ``shape`` against float64 and time them with ``torch.mm``."""
    import ml_dtypes
    import numpy as np
    import torch
    import tvm
    from tvm import relax

    from tvmamp.benchmark import max_rel_error, paired_medians

    torch.set_num_threads(1)
    m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    ref = a.astype("float64") @ b.astype("float64")
    ta, tb = (torch.from_numpy(v.astype("float32")).bfloat16() for v in (a, b))
    args = [tvm.runtime.tensor(a), tvm.runtime.tensor(b)]
    rows, fns = [], []
    for job, plan in entries:
        vm = relax.VirtualMachine(tvm.runtime.load_module(job[4]), tvm.cpu())
        err = max_rel_error(vm["main"](*args).numpy(), ref)
        label = "automatic" if job[1] is None and job[2] is None else f"n {job[1]}, k {job[2]}"
        rows.append((label, plan, err))
        fns.append(lambda vm=vm: vm["main"](*args))
    times = paired_medians([*fns, lambda: torch.mm(ta, tb)], repeat)
    gflop = 2.0 * m * n * k / 1e9
    print(
        f"\n{m} x {k} x {n}: torch bf16 {gflop / times[-1]:.0f} GFLOP/s\n\n"
        "| forced blocks | plan (n_block, k_block, k_padded) | GFLOP/s | / torch | rel err |\n"
        "|---|---|---|---|---|"
    )
    for (label, plan, err), seconds in sorted(zip(rows, times), key=lambda r: r[1]):
        print(
            f"| {label} | {plan} | {gflop / seconds:.0f} | {times[-1] / seconds:.2f} | {err:.1e} |"
        )


if __name__ == "__main__":
    main()
