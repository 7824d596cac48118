#include "textflag.h"

// The most a frame pointer may lie above the one before it, in bytes: a frame larger than this
// (a Go function with over 1 MiB of locals) ends the walk, incomplete.
#define MAXSTEP $0x100000

// CHECK(fail) checks R9, the frame pointer of the frame whose PC is in DX (stored or skipped),
// before anything is read through it: 0 ends the chain (the goroutine's outermost frame saved the
// 0 it started with; DX, the PC it returns to, is in runtime.goexit, which runtime.Callers gives
// too); else it must be 8-byte aligned, above BX, the frame pointer checked before it, but at
// most MAXSTEP above it (R9-BX-1 < MAXSTEP, unsigned, tells both), and at most R8, two words
// below the top of the goroutine's stack. Then it reads the next frame: its PC into DX and its
// frame pointer into R9.
#define CHECK(fail) \
	TESTQ	R9, R9 \
	JEQ	complete \
	TESTQ	$7, R9 \
	JNE	fail \
	LEAQ	-1(R9), R10 \
	SUBQ	BX, R10 \
	CMPQ	R10, MAXSTEP \
	JAE	fail \
	CMPQ	R9, R8 \
	JHI	fail \
	MOVQ	R9, BX \
	MOVQ	8(BX), DX \
	MOVQ	0(BX), R9

// func Callers(skip int, pcs []uintptr) (n int, complete bool)
//
// Frame 1 is our caller's: its PC is our return address, at 0(SP), and its frame pointer is BP,
// which a function with a frame of size 0 leaves as the caller set it. The frame pointer fp of a
// frame holds its caller's frame pointer at 0(fp) and the return address into its caller at
// 8(fp). Each frame pointer is checked before anything is read through it (see CHECK and the
// package's comment).
//
// Registers: CX the frames left to skip; DI pcs; SI len(pcs); AX n; DX the PC of the current
// frame; R9 its frame pointer, not yet checked; BX the frame pointer checked last (at first our
// SP); R8 the top of the goroutine's stack less 16; R10 scratch.
TEXT ·Callers(SB), NOSPLIT, $0-41
	MOVQ	skip+0(FP), CX
	MOVQ	pcs_base+8(FP), DI
	MOVQ	pcs_len+16(FP), SI
	XORQ	AX, AX
	// The running goroutine's g; its first two words are the bounds of its stack, stack.lo and
	// stack.hi (a layout that runtime/cgo's C code and the compiler's stack checks rely on).
	MOVQ	(TLS), R8
	MOVQ	8(R8), R8
	SUBQ	$16, R8
	MOVQ	0(SP), DX
	MOVQ	BP, R9
	MOVQ	SP, BX
	DECQ	CX
	JLE	store // skip <= 1: frame 1 is the first stored

skip:
	CHECK(incomplete)
	DECQ	CX
	JNE	skip

store:
	CMPQ	AX, SI
	JEQ	complete // pcs is full
	MOVQ	DX, (DI)(AX*8)
	INCQ	AX
	CHECK(incomplete)
	JMP	store

complete:
	MOVQ	AX, n+32(FP)
	MOVB	$1, complete+40(FP)
	RET

incomplete:
	MOVQ	AX, n+32(FP)
	MOVB	$0, complete+40(FP)
	RET

// func stackHi() uintptr
TEXT ·stackHi(SB), NOSPLIT, $0-8
	MOVQ	(TLS), AX
	MOVQ	8(AX), AX
	MOVQ	AX, ret+0(FP)
	RET

// func callersFrom(fp uintptr, skip int, pcs []uintptr) (n int, complete bool)
//
// Callers(skip, pcs) called with BP set to fp, as if fp were our frame pointer: frame 2 is then
// the one whose PC is at 8(fp). BP is restored from the slot where the prologue saved it.
TEXT ·callersFrom(SB), NOSPLIT, $48-49
	MOVQ	skip+8(FP), AX
	MOVQ	AX, 0(SP)
	MOVQ	pcs_base+16(FP), AX
	MOVQ	AX, 8(SP)
	MOVQ	pcs_len+24(FP), AX
	MOVQ	AX, 16(SP)
	MOVQ	pcs_cap+32(FP), AX
	MOVQ	AX, 24(SP)
	MOVQ	fp+0(FP), BP
	CALL	·Callers(SB)
	MOVQ	32(SP), AX
	MOVQ	AX, n+40(FP)
	MOVB	40(SP), AX
	MOVB	AX, complete+48(FP)
	RET
