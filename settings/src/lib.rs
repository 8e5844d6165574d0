//! A section of zeropp's config, declared once ([`section!`]): each
//! setting's name, type, default and doc become the section's struct (a
//! table of `--config`'s TOML file and of a checkpoint's manifest, serde),
//! its defaults, its keys, and its command-line flags (clap), each flag
//! with the setting's doc. The application's sections and the engine's
//! `[optim]` table are declared this way; a crate that declares one
//! depends on `serde` (derive) and `clap` (derive) itself.

use std::path::PathBuf;

/// How a flag sets its setting: a value replaces it; an optional setting
/// (the mode's or the plan's to choose while unset) becomes `Some`.
pub trait Setting {
    /// What the flag takes.
    type Flag: Clone;
    fn set(&mut self, flag: Self::Flag);
}

impl<T: Clone> Setting for Option<T> {
    type Flag = T;
    fn set(&mut self, flag: T) {
        *self = Some(flag);
    }
}

/// How a config asks for a setting the mode or a plan may choose instead:
/// an `Option` asks when it is set; a plain value always gives itself, and
/// counts as asked when it is not its default.
pub trait Asked: PartialEq {
    /// The value asked for.
    type Value;
    /// The value, when the config gives one.
    fn asked(&self) -> Option<Self::Value>;
    /// Whether the config asks for this setting itself (`default`: the
    /// setting's declared default).
    fn is_asked(&self, default: &Self) -> bool;
}

impl<T: Clone + PartialEq> Asked for Option<T> {
    type Value = T;
    fn asked(&self) -> Option<T> {
        self.clone()
    }
    fn is_asked(&self, _default: &Self) -> bool {
        self.is_some()
    }
}

/// Settings of these plain types take a flag of the same type, and give
/// their value ([`Asked`]).
macro_rules! plain {
    ($($t:ty),*) => {$(
        impl Setting for $t {
            type Flag = $t;
            fn set(&mut self, flag: $t) {
                *self = flag;
            }
        }

        impl Asked for $t {
            type Value = $t;
            fn asked(&self) -> Option<$t> {
                Some(self.clone())
            }
            fn is_asked(&self, default: &Self) -> bool {
                self != default
            }
        }
    )*};
}
plain!(bool, u32, u64, usize, f32, PathBuf);

/// One section of the config: the struct (with `[serde attributes]` after
/// the names, e.g. `[deny_unknown_fields]` for a table of its own), its
/// defaults, and its flags (`Args`: each setting's flag, with the
/// setting's doc, `None` when not given; `apply` sets what was given).
///
/// ```
/// zeropp_settings::section! {
///     /// The optimizer.
///     Optim / OptimArgs [deny_unknown_fields] {
///         /// Peak learning rate.
///         lr: f32 = 3e-3,
///         /// Linear warm-up steps.
///         warmup_steps: usize = 20,
///     }
/// }
/// let mut o = Optim::default();
/// OptimArgs { lr: Some(0.1), ..OptimArgs::default() }.apply(&mut o);
/// assert_eq!((o.lr, o.warmup_steps), (0.1, 20));
/// assert_eq!(Optim::KEYS, &["lr", "warmup_steps"]);
/// ```
#[macro_export]
macro_rules! section {
    (
        $(#[doc = $doc:literal])*
        $name:ident / $args:ident $([$($serde:tt)*])? {
            $( $(#[doc = $fdoc:literal])* $field:ident : $ty:ty = $default:expr ),* $(,)?
        }
    ) => {
        $(#[doc = $doc])*
        #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(default $(, $($serde)*)?)]
        pub struct $name {
            $( $(#[doc = $fdoc])* pub $field: $ty, )*
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $( $field: $default, )* }
            }
        }

        $(#[doc = $doc])*
        #[derive(clap::Args, Clone, Debug, Default)]
        pub struct $args {
            $(
                $(#[doc = $fdoc])*
                #[arg(long)]
                pub $field: Option<<$ty as $crate::Setting>::Flag>,
            )*
        }

        impl $args {
            /// Sets what was given on the command line.
            pub fn apply(&self, c: &mut $name) {
                $(
                    if let Some(v) = self.$field.clone() {
                        $crate::Setting::set(&mut c.$field, v);
                    }
                )*
            }
        }

        impl $name {
            /// The section's keys, in declaration order.
            pub const KEYS: &[&str] = &[$(stringify!($field)),*];
        }
    };
}
