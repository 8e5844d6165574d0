//! The raw UCX (libucp) API zeropp uses, loaded at run time with `dlopen`, so
//! the build never needs UCX and a machine without it gets a clear error.
//! Only this file and `ucx/mod.rs` contain `unsafe`. Parameter structs are
//! zeroed buffers with the few fields zeropp sets written at the offsets of
//! UCX 1.13's headers (`ucp.h`, `ucp_def.h`); `field_mask` tells UCX which
//! fields to read, so the rest stays unread.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};

use libloading::Library;

/// `ucs_status_t`: a 1-byte signed enum (0 = OK, 1 = in progress, < 0 error).
pub type ucs_status_t = i8;
pub type ucs_status_ptr_t = *mut c_void;
pub type ucp_context_h = *mut c_void;
pub type ucp_worker_h = *mut c_void;
pub type ucp_ep_h = *mut c_void;
pub type ucp_address_t = c_void;
pub type ucp_config_t = c_void;
pub type ucp_tag_message_h = *mut c_void;
pub type ucp_tag_t = u64;

pub const UCS_OK: ucs_status_t = 0;
pub const UCS_INPROGRESS: ucs_status_t = 1;
/// Statuses at or below this are errors when carried in a pointer.
const UCS_ERR_LAST: isize = -100;

pub const UCP_API_MAJOR: c_uint = 1;
pub const UCP_API_MINOR: c_uint = 13;

pub const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub const UCP_FEATURE_TAG: u64 = 1 << 0;
/// The worker's event fd (`ucp_worker_get_efd`, `ucp_worker_arm`).
pub const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
/// `UCS_ERR_BUSY`: `ucp_worker_arm` found events still to progress.
pub const UCS_ERR_BUSY: ucs_status_t = -4;
pub const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub const UCS_THREAD_MODE_SINGLE: u32 = 0;
pub const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
pub const UCP_ERR_HANDLING_MODE_PEER: u32 = 1;
pub const UCP_OP_ATTR_FIELD_DATATYPE: u32 = 1 << 3;
pub const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;
pub const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;
pub const UCP_DATATYPE_IOV: u64 = 2;

/// `ucp_err_handler_cb_t`.
pub type ErrHandler = unsafe extern "C" fn(arg: *mut c_void, ep: ucp_ep_h, status: ucs_status_t);

/// `ucp_dt_iov_t`.
#[repr(C)]
pub struct ucp_dt_iov_t {
    pub buffer: *const c_void,
    pub length: usize,
}

/// `ucp_tag_recv_info_t`.
#[repr(C)]
#[derive(Default)]
pub struct ucp_tag_recv_info_t {
    pub sender_tag: ucp_tag_t,
    pub length: usize,
}

/// A zeroed parameter struct, larger than any UCX 1.x version of it.
#[repr(C, align(8))]
pub struct Params(pub [u8; 512]);

impl Params {
    pub fn new() -> Self {
        Params([0; 512])
    }
    pub fn put_u64(&mut self, offset: usize, v: u64) {
        self.0[offset..offset + 8].copy_from_slice(&v.to_ne_bytes());
    }
    pub fn put_u32(&mut self, offset: usize, v: u32) {
        self.0[offset..offset + 4].copy_from_slice(&v.to_ne_bytes());
    }
    pub fn as_ptr(&self) -> *const c_void {
        self.0.as_ptr().cast()
    }
}

impl Default for Params {
    fn default() -> Self {
        Self::new()
    }
}

// Field offsets (x86-64 / aarch64 LP64) of the structs zeropp fills.
pub const PARAMS_FIELD_MASK: usize = 0;
pub const PARAMS_FEATURES: usize = 8;
pub const WORKER_FIELD_MASK: usize = 0;
pub const WORKER_THREAD_MODE: usize = 8;
pub const EP_FIELD_MASK: usize = 0;
pub const EP_ADDRESS: usize = 8;
pub const EP_ERR_MODE: usize = 16;
pub const EP_ERR_HANDLER_CB: usize = 24;
pub const EP_ERR_HANDLER_ARG: usize = 32;
pub const REQ_OP_ATTR_MASK: usize = 0;
pub const REQ_FLAGS: usize = 4;
pub const REQ_DATATYPE: usize = 24;

/// `UCS_PTR_IS_ERR`.
pub fn ptr_is_err(p: ucs_status_ptr_t) -> bool {
    (p as usize) >= (UCS_ERR_LAST as usize)
}

/// The status carried by an error pointer.
pub fn ptr_status(p: ucs_status_ptr_t) -> ucs_status_t {
    (p as isize) as ucs_status_t
}

/// The functions of libucp.
pub struct Ucp {
    _lib: Library,
    pub config_read:
        unsafe extern "C" fn(*const c_char, *const c_char, *mut *mut ucp_config_t) -> ucs_status_t,
    pub config_release: unsafe extern "C" fn(*mut ucp_config_t),
    pub config_modify:
        unsafe extern "C" fn(*mut ucp_config_t, *const c_char, *const c_char) -> ucs_status_t,
    pub init_version: unsafe extern "C" fn(
        c_uint,
        c_uint,
        *const c_void,
        *const ucp_config_t,
        *mut ucp_context_h,
    ) -> ucs_status_t,
    pub cleanup: unsafe extern "C" fn(ucp_context_h),
    pub worker_create:
        unsafe extern "C" fn(ucp_context_h, *const c_void, *mut ucp_worker_h) -> ucs_status_t,
    pub worker_destroy: unsafe extern "C" fn(ucp_worker_h),
    pub worker_get_address:
        unsafe extern "C" fn(ucp_worker_h, *mut *mut ucp_address_t, *mut usize) -> ucs_status_t,
    pub worker_release_address: unsafe extern "C" fn(ucp_worker_h, *mut ucp_address_t),
    pub worker_progress: unsafe extern "C" fn(ucp_worker_h) -> c_uint,
    pub worker_get_efd: unsafe extern "C" fn(ucp_worker_h, *mut c_int) -> ucs_status_t,
    pub worker_arm: unsafe extern "C" fn(ucp_worker_h) -> ucs_status_t,
    pub ep_create: unsafe extern "C" fn(ucp_worker_h, *const c_void, *mut ucp_ep_h) -> ucs_status_t,
    pub ep_close_nbx: unsafe extern "C" fn(ucp_ep_h, *const c_void) -> ucs_status_ptr_t,
    pub tag_send_nbx: unsafe extern "C" fn(
        ucp_ep_h,
        *const c_void,
        usize,
        ucp_tag_t,
        *const c_void,
    ) -> ucs_status_ptr_t,
    pub tag_probe_nb: unsafe extern "C" fn(
        ucp_worker_h,
        ucp_tag_t,
        ucp_tag_t,
        c_int,
        *mut ucp_tag_recv_info_t,
    ) -> ucp_tag_message_h,
    pub tag_msg_recv_nbx: unsafe extern "C" fn(
        ucp_worker_h,
        *mut c_void,
        usize,
        ucp_tag_message_h,
        *const c_void,
    ) -> ucs_status_ptr_t,
    pub request_check_status: unsafe extern "C" fn(*mut c_void) -> ucs_status_t,
    pub request_free: unsafe extern "C" fn(*mut c_void),
    pub status_string: unsafe extern "C" fn(ucs_status_t) -> *const c_char,
}

/// Why libucp cannot be used here, and what to do.
#[derive(Clone, Debug, thiserror::Error)]
pub enum NotLoaded {
    #[error(
        "UCX is not installed ({0}): install it with `apt-get install libucx0` (Debian/Ubuntu), \
         or use the TCP transport (ZEROPP_TRANSPORT=tcp)"
    )]
    Missing(String),
    #[error("libucp lacks {symbol}: {why}; zeropp needs UCX 1.9 or newer")]
    Old { symbol: String, why: String },
}

impl Ucp {
    /// Loads libucp, or says which package to install.
    pub fn load() -> Result<Ucp, NotLoaded> {
        // SAFETY: loading a shared library runs its initialisers; libucp's
        // are the library's own business, as with any linked C library.
        let lib = unsafe { Library::new("libucp.so.0") }
            .map_err(|e| NotLoaded::Missing(e.to_string()))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol's type is the prototype in UCX 1.x's ucp.h.
                *unsafe { lib.get($name) }.map_err(|e| NotLoaded::Old {
                    symbol: String::from_utf8_lossy($name).into_owned(),
                    why: e.to_string(),
                })?
            };
        }
        Ok(Ucp {
            config_read: sym!(b"ucp_config_read"),
            config_release: sym!(b"ucp_config_release"),
            config_modify: sym!(b"ucp_config_modify"),
            init_version: sym!(b"ucp_init_version"),
            cleanup: sym!(b"ucp_cleanup"),
            worker_create: sym!(b"ucp_worker_create"),
            worker_destroy: sym!(b"ucp_worker_destroy"),
            worker_get_address: sym!(b"ucp_worker_get_address"),
            worker_release_address: sym!(b"ucp_worker_release_address"),
            worker_progress: sym!(b"ucp_worker_progress"),
            worker_get_efd: sym!(b"ucp_worker_get_efd"),
            worker_arm: sym!(b"ucp_worker_arm"),
            ep_create: sym!(b"ucp_ep_create"),
            ep_close_nbx: sym!(b"ucp_ep_close_nbx"),
            tag_send_nbx: sym!(b"ucp_tag_send_nbx"),
            tag_probe_nb: sym!(b"ucp_tag_probe_nb"),
            tag_msg_recv_nbx: sym!(b"ucp_tag_msg_recv_nbx"),
            request_check_status: sym!(b"ucp_request_check_status"),
            request_free: sym!(b"ucp_request_free"),
            status_string: sym!(b"ucs_status_string"),
            _lib: lib,
        })
    }

    /// UCX's name of a status.
    pub fn describe(&self, s: ucs_status_t) -> String {
        // SAFETY: ucs_status_string returns a static C string for any status.
        let p = unsafe { (self.status_string)(s) };
        if p.is_null() {
            return format!("status {s}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_pointers_decode_like_ucs_ptr_is_err() {
        assert!(!ptr_is_err(std::ptr::null_mut()));
        assert!(!ptr_is_err(0x1000 as ucs_status_ptr_t));
        let err = (-3isize) as usize as ucs_status_ptr_t; // UCS_ERR_NO_MEMORY
        assert!(ptr_is_err(err));
        assert_eq!(ptr_status(err), -3);
        assert_eq!(std::mem::size_of::<ucp_dt_iov_t>(), 16);
        assert_eq!(std::mem::size_of::<ucp_tag_recv_info_t>(), 16);
    }
}
