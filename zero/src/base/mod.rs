//! What everything else stands on: where the ranks sit ([`layout`]), the
//! groups they talk in ([`groups`]), what the probe measured ([`measured`]),
//! the byte counters ([`traffic`]) and the wire's byte formats
//! ([`payload`]).

pub mod groups;
pub mod layout;
pub mod measured;
pub mod payload;
pub mod traffic;
