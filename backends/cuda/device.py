"""What a CUDA kernel asks of the machine, emitted for a GPU (`Ptx`) or for the CPU emulator (`Emulated`).

Kernels are written once against this interface: thread and block indices, the
block barrier, the warp's xor shuffle, shared memory, and the kernel's own
signature. `Ptx` emits the `llvm.nvvm.*` intrinsics, the `ptx_kernel` calling
convention and `addrspace(3)` shared memory; `Emulated` emits calls into
`emulator.c`, plain globals for shared memory, and beside each kernel a
`<name>.host(i8** params)` entry that unpacks a `cuLaunchKernel`-style parameter
array, so the host build runs the same code the GPU would:

    dev = Ptx()                                     # or Emulated()
    fn = dev.kernel(module, "rms_norm_k576", [I8PTR, I8PTR, I8PTR, I64])
    tid = dev.tid(f)                                # i64
    total = dev.warp_sum(f, partial)                # xor shuffles over the warp
"""

from __future__ import annotations

from llvmlite import ir

from llmc.backends.builder import F32, I32, I64, VOID, KernelBuilder

WARP = 32
_I8PTR = ir.IntType(8).as_pointer()


class _Device:
    """The shared parts: sums and maxima over a warp or a block, on top of `shfl_xor` and `barrier`."""

    def _sreg(self, f: KernelBuilder, name: str) -> ir.Value:
        raise NotImplementedError

    def tid(self, f: KernelBuilder) -> ir.Value:
        return self._sreg(f, "tid.x")

    def ctaid(self, f: KernelBuilder, axis: str) -> ir.Value:
        return self._sreg(f, f"ctaid.{axis}")

    def lanes(self, f: KernelBuilder) -> tuple[ir.Value, ir.Value, ir.Value]:
        """This thread's index in the block, its lane in the warp, its warp in the block."""
        tid = self.tid(f)
        return tid, f.b.urem(tid, f.i64(WARP)), f.b.udiv(tid, f.i64(WARP))

    def barrier(self, f: KernelBuilder) -> None:
        raise NotImplementedError

    def shfl_xor(self, f: KernelBuilder, value: ir.Value, mask: int) -> ir.Value:
        raise NotImplementedError

    def shfl_xor_i32(self, f: KernelBuilder, value: ir.Value, mask: int) -> ir.Value:
        raise NotImplementedError

    def shared(self, f: KernelBuilder, name: str, count: int) -> ir.Value:
        """A block's `float[count]` in shared memory, as a generic `float*`."""
        raise NotImplementedError

    def warp_reduce(self, f: KernelBuilder, value: ir.Value, combine) -> ir.Value:
        """`combine` over the 32 lanes of the warp, in every lane (a butterfly of xor shuffles)."""
        for mask in (16, 8, 4, 2, 1):
            value = combine(value, self.shfl_xor(f, value, mask))
        return value

    def warp_sum(self, f: KernelBuilder, value: ir.Value) -> ir.Value:
        return self.warp_reduce(f, value, f.fadd)

    def block_sum(self, f: KernelBuilder, value: ir.Value, warps: int, name: str) -> ir.Value:
        """The sum of `value` over a block of `warps` warps, in every thread (two barriers)."""
        partial = self.warp_sum(f, value)
        if warps == 1:
            return partial
        slots = self.shared(f, name, warps)
        _, lane, warp = self.lanes(f)
        with f.when(f.b.icmp_unsigned("==", lane, f.i64(0))):
            f.store(partial, slots, warp)
        self.barrier(f)
        total = f.f32(0.0)
        for w in range(warps):
            total = f.fadd(total, f.load(slots, w))
        self.barrier(f)  # the slots may be reused at once
        return total


_HALF2 = ir.VectorType(ir.HalfType(), 2)


class Ptx(_Device):
    """For the GPU: NVVM intrinsics, `ptx_kernel` functions, shared memory in `addrspace(3)`."""

    def kernel(self, module: ir.Module, name: str, params: list[ir.Type], threads: int) -> ir.Function:
        fn = ir.Function(module, ir.FunctionType(VOID, params), name=name)
        fn.calling_convention = "ptx_kernel"
        for arg in fn.args:
            if isinstance(arg.type, ir.PointerType):
                arg.add_attribute("noalias")  # O3 then loads read-only data through the non-coherent cache
        _launch_bound(fn, threads)
        return fn

    def _sreg(self, f: KernelBuilder, name: str) -> ir.Value:
        full = f"llvm.nvvm.read.ptx.sreg.{name}"
        fn = f.module.globals.get(full) or ir.Function(f.module, ir.FunctionType(I32, []), name=full)
        return f.b.zext(f.b.call(fn, []), I64)

    def barrier(self, f: KernelBuilder) -> None:
        name = "llvm.nvvm.barrier0"
        fn = f.module.globals.get(name) or ir.Function(f.module, ir.FunctionType(VOID, []), name=name)
        f.b.call(fn, [])

    def shfl_xor(self, f: KernelBuilder, value: ir.Value, mask: int) -> ir.Value:
        name = "llvm.nvvm.shfl.sync.bfly.f32"
        fn = f.module.globals.get(name) or ir.Function(f.module, ir.FunctionType(F32, [I32, F32, I32, I32]), name=name)
        return f.b.call(fn, [ir.Constant(I32, 0xFFFFFFFF), value, ir.Constant(I32, mask), ir.Constant(I32, 0x1F)])

    def shfl_xor_i32(self, f: KernelBuilder, value: ir.Value, mask: int) -> ir.Value:
        name = "llvm.nvvm.shfl.sync.bfly.i32"
        fn = f.module.globals.get(name) or ir.Function(f.module, ir.FunctionType(I32, [I32] * 4), name=name)
        return f.b.call(fn, [ir.Constant(I32, 0xFFFFFFFF), value, ir.Constant(I32, mask), ir.Constant(I32, 0x1F)])

    def mma_f16(self, f: KernelBuilder, a: list[ir.Value], b: list[ir.Value], c: list[ir.Value]) -> list[ir.Value]:
        """`D = A·B + C` of one warp (`mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`): `a` four and
        `b` two i32 registers of f16 pairs, `c` four floats, in the PTX fragment layout."""
        name = "llvm.nvvm.mma.m16n8k16.row.col.f32.f32"
        ty = ir.FunctionType(ir.LiteralStructType([F32] * 4), [_HALF2] * 6 + [F32] * 4)
        fn = f.module.globals.get(name) or ir.Function(f.module, ty, name=name)
        d = f.b.call(fn, [f.b.bitcast(r, _HALF2) for r in (*a, *b)] + list(c))
        return [f.b.extract_value(d, i) for i in range(4)]

    def shared(self, f: KernelBuilder, name: str, count: int) -> ir.Value:
        g = _global(f, name, count, addrspace=3)
        return f.b.addrspacecast(f.b.bitcast(g, ir.PointerType(F32, 3)), ir.PointerType(F32))


class Emulated(_Device):
    """For the CPU emulator (`emulator.c`): the same kernels, their intrinsics as calls into it."""

    def kernel(self, module: ir.Module, name: str, params: list[ir.Type], threads: int) -> ir.Function:
        fn = ir.Function(module, ir.FunctionType(VOID, params), name=name)
        fn.linkage = "internal"
        host = ir.Function(module, ir.FunctionType(VOID, [_I8PTR.as_pointer()]), name=f"{name}.host")
        b = ir.IRBuilder(host.append_basic_block("entry"))
        args = [b.load(b.bitcast(b.load(b.gep(host.args[0], [ir.Constant(I64, i)])), t.as_pointer()))
                for i, t in enumerate(params)]
        b.call(fn, args)
        b.ret_void()
        return fn

    def _sreg(self, f: KernelBuilder, name: str) -> ir.Value:
        full = "emu_" + name.replace(".", "_")
        fn = f.module.globals.get(full) or ir.Function(f.module, ir.FunctionType(I32, []), name=full)
        return f.b.zext(f.b.call(fn, []), I64)

    def barrier(self, f: KernelBuilder) -> None:
        fn = f.module.globals.get("emu_barrier") or ir.Function(f.module, ir.FunctionType(VOID, []), name="emu_barrier")
        f.b.call(fn, [])

    def shfl_xor(self, f: KernelBuilder, value: ir.Value, mask: int) -> ir.Value:
        name = "emu_shfl_xor_f32"
        fn = f.module.globals.get(name) or ir.Function(f.module, ir.FunctionType(F32, [F32, I32]), name=name)
        return f.b.call(fn, [value, ir.Constant(I32, mask)])

    def shfl_xor_i32(self, f: KernelBuilder, value: ir.Value, mask: int) -> ir.Value:
        name = "emu_shfl_xor_i32"
        fn = f.module.globals.get(name) or ir.Function(f.module, ir.FunctionType(I32, [I32, I32]), name=name)
        return f.b.call(fn, [value, ir.Constant(I32, mask)])

    def mma_f16(self, f: KernelBuilder, a: list[ir.Value], b: list[ir.Value], c: list[ir.Value]) -> list[ir.Value]:
        name = "emu_mma_f16"
        ty = ir.FunctionType(VOID, [I32] * 6 + [ir.PointerType(F32)])
        fn = f.module.globals.get(name) or ir.Function(f.module, ty, name=name)
        slots = f.alloca(F32, 4, name="mma_c")
        for i, v in enumerate(c):
            f.store(v, slots, i)
        f.b.call(fn, [*a, *b, slots])
        return [f.load(slots, i) for i in range(4)]

    def shared(self, f: KernelBuilder, name: str, count: int) -> ir.Value:
        return f.b.bitcast(_global(f, name, count, addrspace=0), ir.PointerType(F32))


def _global(f: KernelBuilder, name: str, count: int, addrspace: int) -> ir.GlobalVariable:
    full = f"{f.fn.name}.{name}"
    g = f.module.globals.get(full)
    if g is None:
        g = ir.GlobalVariable(f.module, ir.ArrayType(F32, count), name=full, addrspace=addrspace)
        g.linkage = "internal"
        g.initializer = ir.Constant(ir.ArrayType(F32, count), None if addrspace == 0 else ir.Undefined)
        g.align = 16
    return g


class _StringAttributes(ir.FunctionAttributes):
    """Function attributes that may be `"key"="value"` strings (llvmlite knows only keywords)."""

    def __init__(self, strings: dict[str, str]):
        super().__init__()
        self.strings = strings

    def __len__(self) -> int:  # llvmlite prints the attributes only if the set is not empty
        return super().__len__() + len(self.strings)

    def _to_list(self, ret_type):
        return super()._to_list(ret_type) + [f'"{k}"="{v}"' for k, v in self.strings.items()]


def _launch_bound(fn: ir.Function, threads: int) -> None:
    fn.attributes = _StringAttributes({"nvvm.maxntid": str(threads)})
