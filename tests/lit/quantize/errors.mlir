// quantize refuses a module before `optimize`, and an option it does not have, in one line each.
// RUN: not llmc-opt %s -p quantize 2>&1 | filecheck %s --check-prefix=PHASE
// RUN: not llmc-opt %s -p 'quantize{bits=4}' 2>&1 | filecheck %s --check-prefix=OPTION

// PHASE:   llmc: error: pass 'quantize' needs IR after phase 'optimize'; this module is at phase 'import'
// OPTION:  llmc: error: pass 'quantize{bits=4}': Provided arguments ["bits"] not found
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>, llm.phase = "import"} {
  func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %h: tensor<?x32xf32>) -> tensor<?x48xf32> {
    %up = llm.weight @up f32 : tensor<48x32xf32>
    %u = llm.matmul %h, %up : (tensor<?x32xf32>, tensor<48x32xf32>) -> tensor<?x48xf32>
    func.return %u : tensor<?x48xf32>
  }
}
