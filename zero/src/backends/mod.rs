//! The two interfaces the collectives are written over ([`backend`]:
//! `Quantizer`, `ByteMover`) and their three backends: the host ([`host`]),
//! the emulated device ([`emulated`]) and the GPU ([`device`]); what a
//! device job needs of a device ([`devices`]) and the order of its work
//! ([`work`]: queues, the asynchronous calls and their watchdog).

pub mod backend;
pub mod device;
pub mod devices;
pub mod emulated;
pub mod host;
pub mod work;
