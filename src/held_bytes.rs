//! A budget for what the filter holds in its wasm VM across callbacks. Envoy's heap monitor
//! and overload actions cannot see the VM's memory, and an allocation the VM cannot make
//! traps and kills it for every request on the worker; so the few things a request keeps in
//! the VM beyond one callback (a whole body while prefill works, prefill's prompt logprobs
//! until they are in decode's answer) are counted here, and a request that would go past the
//! budget is refused instead.

use std::cell::Cell;
use std::rc::Rc;

/// The bytes held in one VM (one per Envoy worker), shared by its requests.
#[derive(Clone, Debug)]
pub struct HeldBytes {
    held: Rc<Cell<usize>>,
    limit: usize,
}

impl HeldBytes {
    pub fn new(limit: usize) -> HeldBytes {
        HeldBytes {
            held: Rc::new(Cell::new(0)),
            limit,
        }
    }

    /// Room for `bytes` more, given back when the reservation is dropped; `None` when the
    /// budget has no such room.
    pub fn reserve(&self, bytes: usize) -> Option<Reservation> {
        let total = self
            .held
            .get()
            .checked_add(bytes)
            .filter(|total| *total <= self.limit)?;
        self.held.set(total);
        Some(Reservation {
            held: Rc::clone(&self.held),
            bytes,
        })
    }

    pub fn held(&self) -> usize {
        self.held.get()
    }

    pub fn limit(&self) -> usize {
        self.limit
    }
}

/// Bytes counted against a [`HeldBytes`] budget for as long as this lives.
#[derive(Debug)]
pub struct Reservation {
    held: Rc<Cell<usize>>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.held.set(self.held.get().saturating_sub(self.bytes));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_count_until_dropped() {
        let budget = HeldBytes::new(10);
        let first = budget.reserve(6).unwrap();
        assert!(budget.reserve(5).is_none(), "past the limit");
        let second = budget.reserve(4).unwrap();
        assert_eq!(budget.held(), 10);
        drop(first);
        assert_eq!(budget.held(), 4);
        assert!(budget.reserve(6).is_some());
        drop(second);
        assert_eq!(budget.held(), 0);
        assert!(budget.reserve(usize::MAX).is_none());
        assert!(HeldBytes::new(usize::MAX).reserve(usize::MAX).is_some());
    }
}
