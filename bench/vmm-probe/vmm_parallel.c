// Probe: do cuMemCreate / cuMemMap / cuMemSetAccess / cuMemUnmap run in parallel from several host threads?
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char *s; cuGetErrorString(r, &s); fprintf(stderr, "%s:%d %s -> %d %s\n", __FILE__, __LINE__, #x, r, s); exit(1);} } while (0)
static CUcontext ctx; static CUdeviceptr base; static size_t PAGE;
static CUmemAllocationProp prop; static CUmemAccessDesc acc;
static double now(){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec*1e6+t.tv_nsec/1e3; }
#define NP 1024
static CUmemGenericAllocationHandle h[NP];
typedef struct { int lo, hi, op; CUdeviceptr at; } job;
// op 0: create+map+access at base+i*PAGE ; 1: unmap ; 2: map+access at job.at + i*PAGE ; 3: release
static void *work(void *a){ job *j=a; CK(cuCtxSetCurrent(ctx));
  for(int i=j->lo;i<j->hi;i++){
    CUdeviceptr p = j->at + (CUdeviceptr)i*PAGE;
    if(j->op==0){ CK(cuMemCreate(&h[i],PAGE,&prop,0)); CK(cuMemMap(p,PAGE,0,h[i],0)); CK(cuMemSetAccess(p,PAGE,&acc,1)); }
    else if(j->op==1){ CK(cuMemUnmap(p,PAGE)); }
    else if(j->op==2){ CK(cuMemMap(p,PAGE,0,h[i],0)); CK(cuMemSetAccess(p,PAGE,&acc,1)); }
    else if(j->op==3){ CK(cuMemRelease(h[i])); }
    else if(j->op==4){ CK(cuMemMap(p,PAGE,0,h[i],0)); }
  } return 0; }
static double run(int op, int T, int n, CUdeviceptr at){ pthread_t th[64]; job js[64]; double t0=now();
  for(int k=0;k<T;k++){ js[k].lo=n*k/T; js[k].hi=n*(k+1)/T; js[k].op=op; js[k].at=at; pthread_create(&th[k],0,work,&js[k]); }
  for(int k=0;k<T;k++) pthread_join(th[k],0); return now()-t0; }
int main(int argc,char**argv){
  CK(cuInit(0)); CUdevice d; CK(cuDeviceGet(&d,0)); CK(cuDevicePrimaryCtxRetain(&ctx,d)); CK(cuCtxSetCurrent(ctx));
  prop.type=CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type=CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id=0;
  acc.location=prop.location; acc.flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t sizes[2]={2<<20, 8<<20};
  for(int si=0;si<2;si++){ PAGE=sizes[si]; int n = si==0?NP:256;
  CK(cuMemAddressReserve(&base, (size_t)4*NP*PAGE, 0, 0, 0));
  CUdeviceptr alt = base + (size_t)2*NP*PAGE;
  int Ts[]={1,2,4,8,16};
  for(int ti=0;ti<5;ti++){ int T=Ts[ti];
    double c=run(0,T,n,base); double u=run(1,T,n,base); double m=run(2,T,n,alt); double u2=run(1,T,n,alt); double m4=run(4,T,n,base);
    // one setAccess over all n mappings at base
    double t0=now(); CK(cuMemSetAccess(base,(size_t)n*PAGE,&acc,1)); double sa=now()-t0;
    // memset check
    CK(cuMemsetD32(base,0x1234,(size_t)n*PAGE/4)); CK(cuCtxSynchronize());
    double u3=run(1,T,n,base); double r=run(3,T,n,base);
    printf("page %zu MiB n=%d threads=%2d: create+map+access %.1f us/page; unmap %.1f; remap+access %.1f; unmap %.1f; map-only %.1f; one setAccess over all %.1f us/page; unmap %.1f; release %.1f us/page\n",
      PAGE>>20,n,T,c/n,u/n,m/n,u2/n,m4/n,sa/n,u3/n,r/n); fflush(stdout);
  }
  CK(cuMemAddressFree(base,(size_t)4*NP*PAGE)); }
  return 0; }
