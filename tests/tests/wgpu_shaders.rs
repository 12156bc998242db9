//! Every WGSL module of grpo-wgpu parses and validates with naga — no adapter needed, so this runs
//! on every CI machine. Also checks the shader rules of DESIGN.md that are easy to state on text.

use grpo_wgpu::ShaderId;
use naga::valid::{Capabilities, ValidationFlags, Validator};

fn capabilities(id: ShaderId) -> Capabilities {
    // Only what the device is asked for: f16 modules need SHADER_FLOAT16, nothing else does
    // (no `enable subgroups;`: naga rejects the directive — DESIGN.md tooling facts).
    let mut caps = Capabilities::empty();
    if id.required_features().contains(wgpu_features_f16()) {
        caps |= Capabilities::SHADER_FLOAT16;
    }
    caps
}

fn wgpu_features_f16() -> grpo_wgpu::shaders::WgpuFeatures {
    grpo_wgpu::shaders::WgpuFeatures::SHADER_F16
}

#[test]
fn every_module_parses_and_validates() {
    for id in ShaderId::ALL {
        let src = id.source();
        let module = match naga::front::wgsl::parse_str(&src) {
            Ok(m) => m,
            Err(e) => panic!("{}: parse error\n{}", id.name(), e.emit_to_string(&src)),
        };
        let info = Validator::new(ValidationFlags::all(), capabilities(id)).validate(&module);
        if let Err(e) = info {
            panic!(
                "{}: validation error\n{}",
                id.name(),
                e.emit_to_string(&src)
            );
        }
        for entry in id.entry_points() {
            assert!(
                module.entry_points.iter().any(|ep| ep.name == *entry),
                "{}: entry point `{entry}` missing",
                id.name()
            );
        }
        assert_eq!(
            module.entry_points.len(),
            id.entry_points().len(),
            "{}: entry point list out of date",
            id.name()
        );
        eprintln!(
            "{}: {} entry points validated",
            id.name(),
            id.entry_points().len()
        );
    }
}

#[test]
fn f16_module_fails_without_the_capability() {
    // Guards the capability wiring above: the f16 module must need SHADER_FLOAT16.
    let id = ShaderId::Vocab(grpo_wgpu::LogitDtype::F16);
    let src = id.source();
    let module = naga::front::wgsl::parse_str(&src).expect("parses");
    assert!(
        Validator::new(ValidationFlags::all(), Capabilities::empty())
            .validate(&module)
            .is_err()
    );
}

#[test]
fn shaders_follow_the_text_rules() {
    for id in ShaderId::ALL {
        let src = id.source();
        // −∞ is never written as a literal or produced by division (WGSL may assume finite math).
        assert!(!src.contains("-inf"), "{}: uses -inf", id.name());
        assert!(!src.contains("1.0 / 0.0"), "{}: divides by zero", id.name());
        // No subgroup directive (naga 30 rejects it).
        assert!(!src.contains("enable subgroups"), "{}", id.name());
    }
    // common.wgsl mirrors the constants MATH.md fixes.
    let common = grpo_wgpu::shaders::COMMON;
    assert!(common.contains("const NEG_BIG: f32 = -3.40282347e38;"));
    assert!(common.contains("const LOG_RATIO_CLAMP: f32 = 20.0;"));
    assert_eq!(-3.40282347e38f32, f32::MIN);
}

#[test]
fn vocab_params_struct_is_32_bytes() {
    // grpo-wgpu's `VocabParams` (bytemuck, `#[repr(C)]`) is asserted to be 32 bytes at compile
    // time; the WGSL struct the uniform binding is read as must have the same size, or the JSD's
    // β fields would be read from the wrong offsets.
    for id in ShaderId::ALL
        .into_iter()
        .filter(|id| matches!(id, ShaderId::Vocab(_)))
    {
        let module = naga::front::wgsl::parse_str(&id.source()).expect("parses");
        let span = module
            .types
            .iter()
            .find(|(_, t)| t.name.as_deref() == Some("VocabParams"))
            .map(|(_, t)| match &t.inner {
                naga::TypeInner::Struct { members, span } => {
                    let names: Vec<_> = members.iter().filter_map(|m| m.name.clone()).collect();
                    assert_eq!(
                        names,
                        [
                            "rows",
                            "vocab",
                            "base",
                            "inv_temp",
                            "beta",
                            "one_minus_beta",
                            "neg_ln_beta",
                            "neg_ln_one_minus_beta"
                        ],
                        "{}: field order",
                        id.name()
                    );
                    *span
                }
                other => panic!("{}: VocabParams is {other:?}", id.name()),
            })
            .expect("VocabParams declared");
        assert_eq!(span, 32, "{}", id.name());
    }
}

#[test]
fn loss_params_struct_is_48_bytes() {
    // grpo-wgpu's `LossParams` (bytemuck, `#[repr(C)]`, twelve 4-byte fields) is asserted to be
    // 48 bytes at compile time; the WGSL uniform must have the same fields in the same order, or
    // the KL clamps (`clamp`, `out_clamp`) would be read from the wrong offsets.
    let module = naga::front::wgsl::parse_str(&ShaderId::Loss.source()).expect("parses");
    let (_, ty) = module
        .types
        .iter()
        .find(|(_, t)| t.name.as_deref() == Some("LossParams"))
        .expect("LossParams declared");
    let naga::TypeInner::Struct { members, span } = &ty.inner else {
        panic!("LossParams is {:?}", ty.inner);
    };
    let fields: Vec<_> = members
        .iter()
        .map(|m| (m.name.clone().unwrap_or_default(), m.offset))
        .collect();
    let want = [
        "n",
        "kind",
        "flags",
        "seqs",
        "lo",
        "hi",
        "clamp",
        "dual_c",
        "delta",
        "tau_pos",
        "tau_neg",
        "out_clamp",
    ];
    assert_eq!(
        fields,
        want.iter()
            .enumerate()
            .map(|(i, n)| (n.to_string(), 4 * i as u32))
            .collect::<Vec<_>>()
    );
    assert_eq!(*span, 48);
}
