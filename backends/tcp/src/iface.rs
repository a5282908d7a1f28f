//! Network interfaces by name (`CONSORT_SOCKET_IFNAME`, as
//! GLOO_SOCKET_IFNAME): the address to listen on and advertise when a host
//! has several and the default route is the wrong one.

use std::{ffi::CStr, io, net::IpAddr};

/// Every address of every interface, as `(name, address)`.
pub fn addresses() -> io::Result<Vec<(String, IpAddr)>> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null interface name is a NUL-terminated C string.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and points at a sockaddr whose family
        // says which struct it is.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: family AF_INET means a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes())
            }
            libc::AF_INET6 => {
                // SAFETY: family AF_INET6 means a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::from(sin6.sin6_addr.s6_addr)
            }
            _ => continue,
        };
        out.push((name, ip));
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The address of interface `name`: its IPv4 address if it has one, else
/// its first non-link-local IPv6 address. The error lists the interfaces
/// that exist.
pub fn interface_addr(name: &str) -> io::Result<IpAddr> {
    let all = addresses()?;
    let mine: Vec<IpAddr> = all
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, ip)| *ip)
        .collect();
    let pick = mine
        .iter()
        .find(|ip| ip.is_ipv4())
        .or_else(|| {
            mine.iter()
                .find(|ip| matches!(ip, IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) != 0xfe80))
        })
        .or(mine.first());
    pick.copied().ok_or_else(|| {
        let mut names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("no network interface named {name:?} with an address; this host has {names:?}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_found_and_unknown_names_list_the_real_ones() {
        let lo = interface_addr("lo").unwrap();
        assert!(lo.is_loopback(), "{lo}");
        let e = interface_addr("no-such-nic0").unwrap_err().to_string();
        assert!(e.contains("\"lo\""), "{e}");
    }
}
