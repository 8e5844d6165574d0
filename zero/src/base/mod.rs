//! What everything else stands on: where the ranks sit ([`layout`]), the
//! groups they talk in ([`groups`]), what the probe measured ([`measured`])
//! and the byte counters ([`traffic`]).

pub mod groups;
pub mod layout;
pub mod measured;
pub mod traffic;
