//! How many of the plugin's configured root contexts one VM holds. Envoy tells a root it is
//! done when its configuration goes (a new one pushed, the listener drained or removed). Where
//! the VM holds another root (a new configuration on the same `vm_config`), the VM lives on
//! and the done root may finish its calls first. Where it was the VM's last (the listener
//! removed, or the new configuration needs another VM: another `vm_id`, other code, as an
//! Istio `WasmPlugin` image update brings), Envoy 1.40 ends the VM as soon as the root has
//! been told, and whatever the root still had to send goes with it.

/// The configured roots of one VM that Envoy has not yet told they are done.
#[derive(Debug, Default)]
pub struct VmRoots {
    live: u32,
}

impl VmRoots {
    /// A root took its configuration.
    pub fn configured(&mut self) {
        self.live = self.live.saturating_add(1);
    }

    /// A configured root is done; whether it was the VM's last, so that the VM goes with it.
    pub fn done(&mut self) -> bool {
        self.live = self.live.saturating_sub(1);
        self.live == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_root_replaced_within_its_vm_is_not_the_last() {
        let mut roots = VmRoots::default();
        roots.configured();
        // The new configuration's root comes before the old one is done.
        roots.configured();
        assert!(!roots.done());
        assert!(roots.done());
    }

    #[test]
    fn the_only_root_is_the_last() {
        let mut roots = VmRoots::default();
        roots.configured();
        assert!(roots.done());
    }

    #[test]
    fn more_done_than_configured_stays_at_none() {
        let mut roots = VmRoots::default();
        assert!(roots.done());
        roots.configured();
        assert!(roots.done());
    }
}
