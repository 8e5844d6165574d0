//! Which instruction set the kernels run with. The same Rust code is compiled
//! twice — for the baseline target and with AVX2 enabled — and picked at run
//! time; both do the same IEEE operations in the same order, so their results
//! are identical bit for bit (tests check it).

/// An instruction set the kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// The build target's baseline (SSE2 on x86-64).
    Portable,
    /// x86-64 with AVX2: eight f32 lanes per instruction.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The best instruction set this CPU supports.
    #[inline]
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            return Isa::Avx2;
        }
        Isa::Portable
    }

    /// Every instruction set this CPU can run (for tests and benchmarks).
    pub fn available() -> Vec<Isa> {
        let mut all = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            all.push(Isa::Avx2);
        }
        all
    }
}
